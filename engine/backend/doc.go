// Package backend states what a backend computes for the engine, so that the
// CPU backend (package cpu, pure Go, the default everywhere) and the CUDA one
// (package cuda, build tag cuda) are interchangeable.
//
// A backend holds the model's weights and the KV pool where it computes:
// host memory for the CPU backend, device memory for a GPU. Its life:
//
//	b.Load(m)                 // upload the weights, once
//	b.AttachPool(cache)       // the pool: geometry and host region (for the CPU, the pages themselves)
//	for each step of a request:
//	    b.SetEpochs(pages, epochs) // mirror the pool's current epochs of the step's pages
//	    err := b.Forward(&step)    // KV of step.Tokens into the pages, attention over them, logits
//	b.UploadPages(pages)      // pages that arrived over the transport into host memory, after verification
//	b.DownloadPages(pages)    // pages computed on the device, into host memory before the transport sends them
//
// Forward checks tags where it reads: every page of the table it reads or
// writes is compared, at read time, with the page's current epoch in the
// backend's mirror (a device backend compares inside its attention kernel and
// reports the first mismatch in a status word that comes back with the
// logits). A mismatch is a *kv.TagError naming the page; the step's KV must
// not have been written into a page that failed the check, and the logits are
// then meaningless. With Step.Unchecked (the research switch no-tag-check) the
// comparison is skipped: that is how a demo shows a foreign page leaking.
//
// A backend is used by one goroutine at a time.
package backend
