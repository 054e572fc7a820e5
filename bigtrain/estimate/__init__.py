"""Memory per rank for each ZeRO stage x offload x activation checkpointing: the pure model (`memory_model`)
and `bigtrain estimate` with its torch measurements (`cli`)."""
