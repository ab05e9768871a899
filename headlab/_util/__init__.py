"""headlab's own plumbing, no part of its API: atomic file writes (`io`), checkpoints of
long loops (`checkpoint`), progress bars and interruption (`progress`), interleaved
timing (`timing`) and input file checks (`filecheck`)."""
