"""The optimizer's state beside the tiers: the layout of subgroups and step counts, the params' memory
and versions, checkpoints in torch's format, the state format, the step ledger and the bytes held."""
