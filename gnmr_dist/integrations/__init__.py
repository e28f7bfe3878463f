"""Framework integrations (DeepSpeed, Megatron-core): the top layer, imported only when used."""
