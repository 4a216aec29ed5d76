// Package explore binds the executable spec to the generic model checker: it
// checks a configuration and turns the checker's traces into numbered, readable
// steps; it runs seeded simulations; it computes the defense matrix, the
// smallest combinations of switches that expose each bug of the catalogue; and
// it reports coverage, how often each action and guarded branch of the spec
// fired during a check (Options.Coverage, CoverageRows).
//
// A combination counts as exposing its switches only through a counterexample
// that needs every one of them: replayed with any single switch of the
// combination turned off, the same sequence of actions must no longer reach a
// violation of the same property (or, for a liveness property, must reach a
// state from which the goal is reachable again). Without that rule a switch
// that fails on its own (no-checksum, through the corrupt fault) would seem to
// expose every switch it is paired with.
package explore
