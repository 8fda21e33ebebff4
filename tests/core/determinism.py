"""Same placement whatever the process: the check the core's determinism tests share.

Every rank solves the placement from the same all-gathered costs, so the result must
not depend on anything process-local (``PYTHONHASHSEED``: set and dict iteration order).
"""
import contextlib
import io
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

_DIGEST = """
import hashlib as _hashlib
_digest = _hashlib.sha256()
for _p in placements:
    _digest.update(_p.src_rank.tobytes())
    _digest.update(_p.src_index.tobytes())
print(_digest.hexdigest())
"""


def placement_digests(code: str, hash_seeds=("0", "12345")) -> set:
    """Digests of the placements ``code`` builds (it binds ``placements``, a list), run in
    one fresh interpreter per ``PYTHONHASHSEED`` in ``hash_seeds`` and in this process.
    One element: the same placements everywhere. ``code`` may import test modules of
    this directory."""
    script = f"import sys\nsys.path.insert(0, {HERE!r})\n{code}\n{_DIGEST}"
    digests = set()
    for seed in hash_seeds:
        out = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, PYTHONHASHSEED=seed),
                             capture_output=True, text=True, timeout=120, check=True)
        digests.add(out.stdout.strip())
    here = io.StringIO()
    with contextlib.redirect_stdout(here):
        exec(script, {})
    digests.add(here.getvalue().strip())
    return digests
