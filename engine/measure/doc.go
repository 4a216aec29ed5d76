// Package measure measures the engine: prefill and decode tokens per second
// of a model on a backend, the cost of the read-time tag check, and the price
// of paging, each as a ratio against a baseline measured in the same run.
//
// One Run measures, for one model:
//   - prefill: a prompt of Prompt tokens as one step, over pages of
//     PageTokens;
//   - decode, checked: Decode tokens one step at a time after the prompt,
//     through the page table, every page read checked;
//   - decode, unchecked: the same steps with the check off (research switch
//     no-tag-check), over the same pages on the same backend;
//   - decode, contiguous: the same steps over a cache of one page that spans
//     the whole context, so the same attention code reads one contiguous run
//     of KV and does no table lookups (the baseline for the price of paging).
//
// The three decodes alternate within each round, so drifting machine load
// affects them alike, and the best round of each counts. TagCheckCost is
// 1 - checked/unchecked; PagedOverContiguous is checked paged decode over
// contiguous decode.
package measure
