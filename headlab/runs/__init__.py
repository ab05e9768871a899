"""One run: its configuration (`config`), the checks before the model loads
(`preflight`), what it reads (`inputs`), its stages (`stages`), the run itself and its
directory (`pipeline`), and the lock on that directory (`lock`). The checkpoints that
let an interrupted run resume are `headlab._util.checkpoint`: scoring, iterative pruning
and distillation write them, below the run."""
