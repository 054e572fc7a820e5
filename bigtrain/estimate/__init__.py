"""Memory per rank for each ZeRO stage x offload x activation checkpointing: the pure model (`memory_model`), the setups weighed and the fastest that fits (`recommend`)
and `bigtrain estimate` with its torch measurements (`cli`)."""
