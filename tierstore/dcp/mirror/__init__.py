"""Peer mirror over ``torch.distributed`` (gloo): the exchange after a save, and peer restore."""
