"""``sylvie_comm.diloco``: DiLoCo and Streaming DiLoCo with the project's codecs on the outer step (see
:mod:`sylvie_comm.optim.diloco`)."""

from sylvie_comm.optim.diloco import DiLoCo

__all__ = ["DiLoCo"]
