"""Imported at start-up by every Python that .ci/sanitize.sh runs (.ci is on its PYTHONPATH).

``pip install -e`` (scikit-build-core) puts an import hook first on ``sys.meta_path`` that maps
``infinity`` to the regular build, ahead of PYTHONPATH; without it gone, the sanitized copy
that sanitize.sh puts on PYTHONPATH is never imported. site runs this after the .pth files.
"""

import sys

sys.meta_path[:] = [
    finder for finder in sys.meta_path if not type(finder).__module__.startswith("_editable_skbc_")
]
