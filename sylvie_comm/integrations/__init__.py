"""Thin adapters from training frameworks to the codecs and collectives.

Imported on demand: ``sylvie_comm.ddp`` (PyTorch DDP); optional frameworks are
probed in :mod:`sylvie_comm._deps` and never imported by the core.
"""
