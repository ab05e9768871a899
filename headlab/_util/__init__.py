"""headlab's own plumbing, no part of its API: atomic file writes (`io`), checkpoints of
long loops (`checkpoint`), progress bars and interruption (`progress`), interleaved
timing (`timing`), input file checks (`filecheck`) and callable modules (`modules`)."""
