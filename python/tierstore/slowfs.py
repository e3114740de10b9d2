"""`python -m tierstore.slowfs SOURCE MOUNTPOINT`: the stand-in shared store's command (documented under this
name). The store itself is `tierstore.testing.slowfs`."""

from __future__ import annotations

import sys

from tierstore.testing.slowfs import main

if __name__ == "__main__":
    sys.exit(main())
