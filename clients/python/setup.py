"""Builds the client with the public API's generated modules inside it.

The public protos (`inference/v1/inference.proto`, `jobs.proto` and the `types.proto` they
import; never the workers' internal `worker.proto`) are compiled from the repository's proto/
directory (or a `proto/` copied next to this file, for a source distribution) into
`inference_fabric_client/_pb/`, and their imports re-rooted under the package.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
PUBLIC_PROTOS = (
    "inference/v1/types.proto",
    "inference/v1/inference.proto",
    "inference/v1/jobs.proto",
)


def _proto_root() -> Path:
    for root in (HERE / "proto", HERE.parents[1] / "proto"):
        if (root / PUBLIC_PROTOS[0]).exists():
            return root
    raise FileNotFoundError("proto/ not found next to setup.py nor at the repository root")


def _generate(out: Path) -> None:
    from grpc_tools import protoc  # a build requirement (pyproject.toml)

    target = out / "inference_fabric_client" / "_pb"
    target.mkdir(parents=True, exist_ok=True)
    root = _proto_root()
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{root}", f"-I{include}", f"--python_out={target}",
            f"--pyi_out={target}", f"--grpc_python_out={target}", *PUBLIC_PROTOS]  # fmt: skip
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    for path in target.rglob("*.py*"):
        text = re.sub(r"^from inference([. ])", r"from inference_fabric_client._pb.inference\1",
                      path.read_text(), flags=re.M)  # fmt: skip
        path.write_text(text)
    for directory in [target, *[d for d in target.rglob("*") if d.is_dir()]]:
        (directory / "__init__.py").touch()


class BuildWithProtos(build_py):
    def run(self) -> None:
        super().run()
        _generate(Path(self.build_lib))


class SdistWithProtos(sdist):
    """A source distribution carries the public protos in `proto/`, where `_proto_root` looks
    first: a wheel is built from it away from the repository."""

    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        root = _proto_root()
        for proto in PUBLIC_PROTOS:
            target = Path(base_dir) / "proto" / proto
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / proto, target)


setup(cmdclass={"build_py": BuildWithProtos, "sdist": SdistWithProtos})
