"""``python -m sylvie_comm.kernels.triton.form``: print the compiled form of every Triton kernel."""

import sys

from sylvie_comm.kernels.triton.form.report import main

sys.exit(main())
