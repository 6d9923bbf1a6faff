"""`testbed image build|info`: the docker runtime's worker image (registered by testbed.cli.build_parser)."""

from __future__ import annotations

import json
import sys


def cmd_image_build(args) -> int:
    from testbed.runtime import image

    try:
        info = image.build_worker(args.tag, base=args.base, no_cache=args.no_cache, rebuild_base=args.rebuild_base,
                                  torch_index=args.torch_index)
    except image.ImageBuildError as e:
        print(f"testbed: {e}", file=sys.stderr)
        return 1
    print(image.describe(info, info.get("tag", args.tag or "")))
    return 0


def cmd_image_info(args) -> int:
    from testbed.runtime import docker as drt
    from testbed.runtime import image

    tag = args.tag or drt.worker_tag()
    info = image.image_info(tag)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(image.describe(info, tag))
    return 0 if info else 1


def register(subparsers) -> None:
    s = subparsers.add_parser("image", help="the docker runtime's worker image",
                              description="Build or describe the worker image that hosts of the docker runtime run.")
    isub = s.add_subparsers(dest="image_command", metavar="ACTION")

    b = isub.add_parser("build", help="build (or refresh) the worker image",
                        description="Build the worker image: base image (python:3.11-slim from a registry, or a "
                                    "Debian bookworm made with debootstrap when no registry answers), a cached "
                                    "dependency image with the host environment's package versions (CPU torch), and "
                                    "the testbed package on top. Cached: a rebuild after a code change takes seconds. "
                                    "Needs a Docker engine (containers/ensure-docker.sh).")
    b.add_argument("--tag", help="image tag (default testbed-worker:latest or $TESTBED_WORKER_IMAGE)")
    b.add_argument("--base", choices=["auto", "registry", "debootstrap"], default="auto",
                   help="where the base image comes from (default auto: a local python:3.11-slim, else an existing "
                        "debootstrap base, else a registry pull, else debootstrap)")
    b.add_argument("--rebuild-base", action="store_true", help="make the debootstrap base again")
    b.add_argument("--no-cache", action="store_true", help="rebuild the dependency and worker layers from scratch")
    b.add_argument("--torch-index", metavar="URL", help="extra index for the CPU torch wheel (default $TORCH_INDEX, "
                   "else pip's own configuration, else https://download.pytorch.org/whl/cpu)")
    b.set_defaults(fn=cmd_image_build)

    i = isub.add_parser("info", help="tag, id (digest) and labels of the worker image",
                        description="Print the worker image's tag, id (sha256 digest of its content), testbed version "
                                    "and base. Exit 1 if it is not built.")
    i.add_argument("--tag")
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=cmd_image_info)

    def usage(args) -> int:
        s.print_help()
        return 2
    s.set_defaults(fn=usage)
