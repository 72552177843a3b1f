"""``python -m megatron_hsap <command> [args]``: same as the ``megatron-hsap`` console script."""

from megatron_hsap.cli import main

raise SystemExit(main())
