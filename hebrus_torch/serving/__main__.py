"""``python -m hebrus_torch.serving`` (the same as ``python -m hebrus_torch.serve``)."""

from .cli import main

main()
