// Package protocol is kvhandoff's implementation of the handoff protocol
// (docs/protocol.md), the code an engine links. It imports only the standard
// library, its checksum package, and internal/research (the switches below).
//
// # The two state machines
//
// [Sender] is the prefill node's side and [Receiver] the decode node's, each
// for every request of its node. Both are sans-I/O, in the style of etcd's
// raft: methods take events (messages from the peer, WRITE completions, cancels,
// ticks with the current time), and the machine accumulates effects that
// Effects hands over: messages and WRITEs to post ([Op], in order per queue
// pair), queue pairs to cut, requests verified for reading, and each request's
// [Outcome], exactly once. There are no goroutines, locks, sockets or clocks
// inside. The engine owns the I/O and the time.
//
// Each queue pair has a [TagKey], made from a secret its two nodes agree on
// over their authenticated connection setup (for TLS 1.3, 32 bytes of
// ExportKeyingMaterial). SenderConfig.TagKeys and ReceiverConfig.TagKeys
// return the key for a peer; they are required, and a request for a peer
// without a key is refused with ErrNoPeerKey, so an engine cannot forget the
// keys and run without them. The sender MACs every tag record under the key
// and the receiver accepts only records whose MAC verifies: a WRITE from
// anyone without the key fails verification with ErrTagMismatch.
//
// An engine's loop on the prefill node:
//
//	pages, err := sender.Submit(id, decodePeer, tokens) // intake; err wraps ErrRejected
//	compute the KV into pages, then sender.Computed(id)
//	    (or a chunk at a time, sender.ComputedPages(id, k) after each: WRITEs follow the chunks)
//	for each event: sender.Step(peer, msg) | sender.Completed(writeID, err) | sender.Cancel(id)
//	    e := sender.Effects()
//	    post e.Ops in order (a Write: payload, then tag record; a Msg: SEND)
//	    report e.Outcomes
//
// and on the decode node:
//
//	for each event: receiver.Step(peer, msg, now) | receiver.Tick(now) | receiver.Cancel(id)
//	    e := receiver.Effects()
//	    SEND e.Sends; cut e.Cuts, then receiver.QueuePairFenced(peer)
//	    for each id in e.Verified: refs, err := receiver.Acquire(id); decode; receiver.Finish(id)
//	    report e.Outcomes
//
// and on the router, which takes clients' requests and the nodes' reports:
//
//	router.AddNode(info) as nodes register; router.NodeLost(id) when a lease expires
//	d, err := router.Submit(id, tokens, now)        // intake; err wraps ErrRejected or ErrNoNode
//	for each event: router.LegEnded(node, id, outcome.Err) | router.Cancel(id) | router.Tick(now)
//	    e := router.Effects()
//	    send e.Dispatches to prefill nodes, e.Cancels to either, e.PeerLost to decode nodes
//	    answer clients with e.Outcomes (one per accepted request)
//
// None of the three is safe for concurrent use. [SharedReceiver] and [SharedSender] are
// the two sides for engines whose workers, router and completion poller call
// them concurrently: one lock per call, so every call is linearizable (package
// linearizability checks this with porcupine on real concurrent runs).
//
// The package example performs one complete handoff this way. Outcome errors
// wrap ErrRejected (with ErrTooLong, ErrTooManyPages or ErrNoPeerKey),
// ErrNoCapacity, ErrBadGrant, ErrTokenMismatch, ErrTagMismatch,
// ErrTagMalformed, ErrChecksumMismatch, ErrCancelled, ErrTimedOut,
// ErrPeerFailed or ErrFenced, so callers match them with errors.Is. Calls that break the protocol (a Done for an unknown request, a
// second Done, a message from the wrong peer, a computed page count outside
// the request: ErrBadComputed) return an error and change nothing; late and duplicate fences are expected and ignored.
//
// # Rule index
//
// Each rule of the protocol, numbered as in docs/protocol.md ("Rule index",
// which also names the spec function that states it), with the functions that
// keep it and the tests that check it. Comments here cite these numbers.
//
//  1. Router intake: Router.Submit, NodeInfo.Limit; TestRouterIntakeRejectsOverEachNodesLimit, TestRouterDispatchesOnlyToNodesThatFit
//  2. Prefill intake: Sender.Submit; TestRejectedAtIntakeIsNeverBootstrapped, TestSenderIntakeRefusesMorePagesThanAGrantCarries
//  3. Decode intake and reserve: Receiver.bootstrap, Pool.Allocate; TestReceiverRejectsWhatItsPoolCannotHoldAndStopsTheSender, TestReceiverIntakeRefusesMorePagesThanAGrantCarries, TestRefusedBootstrapsLeaveNoRecord, TestAllocationAdvancesEveryEpoch, TestAllocationIsAllOrNothing
//  4. Admit: Sender.admit; TestGrantForUnknownRequestIsAnsweredWithAbortAck, TestGrantNamingAPageTwiceIsRefused
//  5. Write: Sender.post, Sender.settle; TestSourcePagesHeldUntilWritesComplete, TestFailedWriteStopsPostingAndFailsTheRequest
//  6. Done behind the WRITEs: Sender.sendDone; TestHandoffDeliversVerifiedBytes, TestDoneBeforeGrantIsRefused
//  7. Verify: Receiver.done, Receiver.verify, VerifyPage; TestTokenMismatchFailsVerification, TestStaleEpochFailsVerification, TestCorruptPayloadFailsByChecksum, TestVerifyPageRejectsForeignStaleOrMisplacedRecords
//  8. Read-time check: Receiver.Acquire, Pool.Check, Receiver.Finish; TestReadCheckFailsOnceThePageChangedHands, TestHandoffDeliversVerifiedBytes
//  9. One outcome: Router.decide, Receiver.finish, Sender.finish; TestRouterFirstOutcomeWins, TestRouterOneOutcomePerRequestAtScale, TestDuplicateDoneIsRefused, TestLateDoneAfterAbortIsOnlyAFence
//  10. Client cancel: Router.Cancel, Sender.Cancel, Receiver.Cancel; TestRouterCancelsBothLegsOnClientDisconnect, TestCancelBeforeBootstrapLeavesATombstone
//  11. Quarantine until the fence: Receiver.abort, Receiver.fence, Pool.Quarantine; TestCancelDuringWritesQuarantinesUntilAbortAck, TestQuarantinedPagesAreNotReusedUntilReleased, TestTimeoutThenLatePlacementLandsOnlyInQuarantine
//  12. Timeouts are faults: Receiver.Tick, Receiver.Expire, Router.Tick; TestTimersFireOnceAtTheirDeadlines, TestExpireTimesOutOnlyThatRequest, TestRouterTimeoutFailsAndCancelsBothLegs
//  13. Queue-pair cut: Receiver.QueuePairFenced, Sender.Flushed; TestPeerFailureIsFencedByACut, TestFlushFailsOnlyThatQueuePairsRequests, TestCutLeavesEndedRecordsAlone
//  14. Lost node: Router.NodeLost, Receiver.PeerFailed; TestRouterNodeLostFailsEveryLegOnIt, TestRouterDecodeLostCancelsPrefillLegs, TestRouterDecodeLostCancelsPrefillLegsUnderNoPeerCancel, TestPeerFailureIsFencedByACut
//  15. Peer cancel: Receiver.tellSender, Router.cancelOpenLegs; TestRouterCancelsOtherLegOnFailedLeg, TestReceiverRejectsWhatItsPoolCannotHoldAndStopsTheSender
//  16. Idempotent fences: Pool.Release, Receiver.fence; TestReleaseIsIdempotent, TestLateReleaseNeverFreesTheNextOwnersPage, TestQuarantineIgnoresPagesNoLongerHeld
//  17. Defensive decoding: DecodeMessage, validate, Receiver.lookup; TestDecoderRejectsBrokenFramesWithTypedErrors, TestMalformedMessagesAreRefusedWithoutEffect, TestWrongDirectionMessagesAreRefused, TestTypedNilMessagesAreRefused, TestRouterRefusesBadReports
//  18. Bounded records: Receiver.Tick, Sender.Tick, Router.Tick; TestEndedRecordsAreForgottenAfterTheHorizon, TestRecordsAtWorkAreNeverForgotten, TestSenderForgetsEndedRecordsAfterTheHorizon, TestRouterHorizonForgetsEndedRecords, TestHorizonQueueNeverForgetsEarly, TestRecordsStayUnderMaxRecordsWithoutAHorizon
//  19. Keyed tag records: NewTagKey, Tag.appendMAC, parseTag, Sender.Submit, Receiver.bootstrap; TestForgedRecordFailsWithoutTheKey, TestReceiverRefusesAStrangersPage, TestNoKeyForThePeerRefusesTheRequest, TestCMACMatchesRFC4493
//  20. Authorized intake and per-peer quotas: Receiver.authorize, Receiver.overQuota, Sender.SubmitTicket; TestBootstrapWithoutAValidTicketReservesNothing, TestOnePeerHoldsNoMoreThanItsQuota, TestBootstrapTicketLengthMustMatchItsBytes
//  21. Prefix lookup and pin, within the scope: Receiver.bootstrap, Pool.LookupPrefix, Pool.Pin, PrefixChain; TestPrefixCacheNeedsAuthorize, TestBootstrapChainMustFitTheRequest, TestPrefixHitNeverCrossesScopes, TestPrefixChainNamesWholePrefixes, TestBootstrapChainLengthMustMatchItsBytesBeforeAllocating
//  22. Prefix lengths agree: Sender.admit, Sender.post, Receiver.verify; TestPrefixHitGrantsAndWritesOnlyThePagesPastIt, TestSenderRefusesAGrantWhosePrefixDoesNotFit
//  23. Shared read check: Receiver.Acquire, Pool.CheckShared; TestEvictionTakesOnlyUnpinnedPagesLeastRecentlyUsedFirst, TestEvictPinnedReallocatesAPinnedPage
//  24. Insert verified pages, unpin on every end, evict only unpinned, leaf first: Receiver.Finish, Receiver.dropSlot, Pool.Insert, Pool.Pin, Pool.TouchChain, Pool.Unpin, Pool.Allocate, Receiver.Audit; TestEvictionTakesOnlyUnpinnedPagesLeastRecentlyUsedFirst, TestEvictionTakesAChainsLeafBeforeItsRoot, TestFinishLeavesAChainsRootTheMostRecentlyUsed, TestPrefixReuseAtScaleKeepsEveryProperty, TestEachPrefixSwitchBreaksAProperty
//  25. Write only computed pages: Sender.ComputedPages, Sender.post; TestAWriteWaitsForItsPageToBeComputed, TestPagesComputedBeforeTheGrantAreWrittenAtIt, TestDoneWaitsForEveryPageToBeComputed, TestComputedPagesRefusesCountsOutsideTheRequest, TestComputedPagesAfterTheRequestEndedChangesNothing, TestStreamingWithAPrefixWritesOnlyThePagesPastIt, TestWriteUncomputedShipsPagesNotComputedYet
//
// # Encodings
//
// The control messages travel as frames of version (1 byte), type (1 byte),
// body length (4 bytes, big-endian, at most MaxBody) and body. [AppendMessage]
// refuses a message that breaks a limit, so every frame it writes decodes.
// [DecodeMessage] tells an incomplete frame (ErrShortFrame: read more) from a
// broken stream (every other error); a [Decoder] does the same into messages
// it reuses, for a receive loop that allocates nothing per frame. The tag record ([Tag], [TagSize] bytes,
// MACed under the queue pair's [TagKey]) is written after each page's
// payload, and [VerifyPage] is the check every page passes before anything
// reads it. [PagesFor] and [TokensInPage] are the page arithmetic both ends of
// the wire must agree on. Both decoders take any input without
// panicking or allocating past the limits.
//
// [Pool] is the page pool both nodes use. Every page is free, owned by one
// request at one epoch, quarantined, or (decode's prefix cache) cached under
// a scope and chain hash, pinned by the requests reading it. Release and
// quarantine name the tenancy they mean, so a duplicate or late fence can
// never free the next owner's page.
//
// # Prefix reuse
//
// With ReceiverConfig.PrefixCache, decode keeps verified full prompt pages
// keyed by ([Scope], [ChainHash]): a Bootstrap carries its request's scope
// (set by the router from the authenticated tenant, bound by its ticket)
// and its prompt's [PrefixChain]; decode pins the longest run it has cached
// in that scope and grants only the rest (Grant.Prefix), the sender writes
// only the pages past it (SubmitWith, Done.Prefix), and Acquire returns the
// pinned prefix pages, read-only, before the written ones.
//
// # Switches
//
// Every bug of the catalogue but done-unmatched (the wire carries no slot;
// internal/research lists them) can be turned on through SenderConfig.Research and
// ReceiverConfig.Research, for research and to prove that the checkers can fail;
// client-scope (the scope taken from the request body) is the router's in
// package node, which sets the scope.
// Their type lives in the module's internal/research package and has an
// unexported field, so only code inside the kvhandoff module can build a value
// with a bug on. An engine that links this package cannot import that package
// or construct such a value, not even by an untyped constant from a config file,
// and gets every defense on. TestEachSwitchBreaksAProperty stages each switch
// the way the spec's defense matrix exposes it and shows the property it breaks.
//
// # Bounds
//
// Nothing is kept on a peer's word: a Bootstrap that intake refuses leaves no
// record, the records of requests that ran are at most
// ReceiverConfig.MaxRecords (the oldest ended one goes first), both intakes
// refuse a request of more pages than one Grant carries (MaxGrantPages), and
// Tick costs what is due (deadlines in a heap, horizons in a queue), not a
// visit of every record.
package protocol
