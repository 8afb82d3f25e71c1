"""Data-parallel training with a sylvie-comm gradient hook.

Run on two processes (CPU, gloo):

    torchrun --nproc_per_node 2 examples/ddp_train.py --codec acpsgd --rank 4
    torchrun --nproc_per_node 2 examples/ddp_train.py --config examples/configs/acpsgd.yaml

The data set is scikit-learn's handwritten digits (it ships inside
scikit-learn); each rank trains on its own shard. The last line reports test
accuracy and the bytes this rank put on the wire, beside what a plain fp32
all-reduce of the same gradients would have sent.

The workload is ``sylvie_comm.demo.ddp_train`` (the one ``sylvie-comm demo``
runs); the integration is a single call in its ``train``:

    ddp = DistributedDataParallel(model)
    state = sylvie_comm.ddp.register(ddp, "acpsgd", rank=4)

This script is its command line, the same as
``torchrun --nproc_per_node 2 -m sylvie_comm.demo.ddp_train ...``.
"""

from sylvie_comm.demo import ddp_train

if __name__ == "__main__":
    ddp_train.main()
