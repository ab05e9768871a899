"""Beyond one process: torch.distributed ranks (`distributed`), FSDP2 sharding of a model
(`sharding`), and the memory estimates that decide whether it fits (`memory`)."""
