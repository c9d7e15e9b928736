"""The filesystem class of the ``cachefs`` protocol (see the package's docstring)."""

from __future__ import annotations

import os
import shutil
from typing import Any

from fsspec.spec import AbstractFileSystem

from cachefs.base.aio import run_sync
from cachefs.base.config import load_config
from cachefs.base.errors import ConfigError, InvalidURLError, ReadOnlyError
from cachefs.base.types import Entry, canonical_url
from cachefs.engine import Dataset, Engine, get_engine
from cachefs.fsspec_fs.file import CacheFile, norm_range, read_range
from cachefs.write.files import ProcessVolumes, VolumeFiles

try:  # fsspec >= 2025.10 marks chaining-aware filesystems with this base class
    from fsspec.implementations.chained import ChainedFileSystem as _Base
except ImportError:  # pragma: no cover - older fsspec
    _Base = AbstractFileSystem

__all__ = ["CacheFileSystem"]


class CacheFileSystem(_Base):
    """Read-only fsspec filesystem over a node-local read-through cache of another filesystem."""

    protocol = "cachefs"
    root_marker = ""

    def __init__(
        self,
        target_protocol: str | None = None,
        target_options: dict[str, Any] | None = None,
        fo: str | None = None,
        *,
        dataset: str | None = None,
        manifest_version: int | None = None,
        cache_dir: str | None = None,
        config: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        target_protocol, target_options, layers, options = _layer_options(target_protocol, target_options, options)
        writable = options.pop("writable", False)
        if writable not in (True, False, "true", "false", 1, 0):
            raise ConfigError(f"writable={writable!r}: True or False")
        self.writable = writable in (True, "true", 1)
        self.volume_url = canonical_url(options.pop("volume")) if options.get("volume") else None
        self._writes: VolumeFiles | None = None
        overrides = {k: v for k, v in options.items() if k not in ("skip_instance_cache", "use_listings_cache",
                                                                    "listings_expiry_time", "max_paths")}
        overrides["cache_dir"] = cache_dir
        self._config = load_config(config, overrides=overrides)
        self._engine: Engine = get_engine(self._config)
        self._pid = os.getpid()
        if target_protocol is None and dataset and "://" in dataset:
            target_protocol = dataset.split("://", 1)[0]
        # None: decided per path (an absolute path is a local file, ``bucket/key`` is S3), so that a bare
        # ``cachefs://bucket/key`` means the object, as it does to every loader that takes single-hop URLs.
        self.target_protocol = target_protocol.lower() if target_protocol else None
        self.target_options = target_options
        self._origin_layers = layers
        self.dataset_url = canonical_url(dataset) if dataset else None
        self.manifest_version = manifest_version
        self._datasets: dict[str, Dataset] = {}

    @property
    def writes(self) -> VolumeFiles:
        """This process's writable volumes (``writable=True`` only)."""
        if not self.writable:
            raise ReadOnlyError('cachefs is read-only here: pass cachefs={"writable": True} to write (S3 only)')
        if self._writes is None or self._pid != os.getpid():
            engine = self.engine
            protocol = self.target_protocol or "s3"
            options = {**self._origin_layers.get(protocol, {}), **self.target_options}
            volumes = ProcessVolumes.of_process(self._config, services=engine.node_services,
                                                storage_options=options)
            self._writes = VolumeFiles(volumes, self.volume_url)
        return self._writes

    @property
    def engine(self) -> Engine:
        """This process's engine: a filesystem inherited through fork (a DataLoader worker) takes the child's
        own, with its own datasets (cachefs.engine drops the parent's in the child)."""
        if self._pid != os.getpid():
            self._engine, self._pid, self._datasets = get_engine(self._config), os.getpid(), {}
        return self._engine

    # -- paths and datasets -------------------------------------------------------------------------------
    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = str(path)
        if path.startswith("cachefs://"):
            path = path[len("cachefs://"):]
        elif "::" in path:
            path = path.split("::", 1)[1]
        if "://" in path:
            path = path.split("://", 1)[1]
        return path.rstrip("/") or path

    def _url(self, path: str) -> str:
        path = self._strip_protocol(path)
        protocol = self.target_protocol or ("file" if path.startswith("/") else "s3")
        if protocol in ("file", "local"):
            return canonical_url("file://" + (path if path.startswith("/") else os.path.abspath(path)))
        return canonical_url(f"{protocol}://{path}")

    def _open_dataset(self, url: str) -> Dataset:
        engine = self.engine  # (first: after a fork it replaces the datasets too)
        ds = self._datasets.get(url)
        if ds is None:
            protocol = url.split("://", 1)[0]
            options = {**self._origin_layers.get(protocol, {}), **self.target_options}
            ds = run_sync(engine.open_dataset(url, storage_options=options,
                                                   manifest_version=self.manifest_version))
            self._datasets[url] = ds
        return ds

    def _resolve(self, path: str, *, as_dir: bool) -> tuple[Dataset, str]:
        url = self._url(path)
        if self.dataset_url:
            root = self.dataset_url
        else:
            known = self.engine.known_dataset_for(url)
            if known is not None:
                root = known.url
            elif as_dir:
                root = url
            else:
                root = url.rsplit("/", 1)[0]
                if root.endswith(":/") or root.endswith("://"):
                    root = url
        if url != root and not url.startswith(root + "/"):
            raise InvalidURLError(f"{url} is outside the dataset {root}")
        return self._open_dataset(root), url[len(root) + 1:] if url != root else ""

    def _info(self, ds: Dataset, e: Entry) -> dict[str, Any]:
        protocol, name = ds.ref.object_url(e.path).split("://", 1)
        if protocol == "file":
            name = name if name.startswith("/") else "/" + name
        info = {"name": name, "size": e.size, "type": "directory" if e.is_dir else "file", "mtime": e.mtime}
        if not e.is_dir:
            info["ETag"] = e.version
        return info

    # -- fsspec API ---------------------------------------------------------------------------------------
    def ls(self, path, detail=True, **kwargs):
        if self.writable:
            return _merge_listings(self, path, detail)
        return self._ls_read(path, detail)

    def _ls_read(self, path, detail=True):
        ds, rel = self._resolve(path, as_dir=True)
        entries = ds.listdir(rel) if ds.stat(rel).is_dir else [ds.stat(rel)]
        infos = [self._info(ds, e) for e in entries]
        return infos if detail else [i["name"] for i in infos]

    def walk(self, path, maxdepth=None, topdown=True, on_error="omit", **kwargs):
        """Like fsspec's walk, straight from the manifest (one range scan per directory)."""
        detail = kwargs.pop("detail", False)
        ds, rel = self._resolve(path, as_dir=True)
        if not ds.stat(rel).is_dir:
            return
        stack = [(rel, 1)]
        while stack:
            d, depth = stack.pop()
            dirs: dict[str, Entry] = {}
            files: dict[str, Entry] = {}
            for e in ds.listdir(d):
                (dirs if e.is_dir else files)[e.name] = e
            root = self._info(ds, ds.stat(d))["name"]
            out: tuple[str, Any, Any]
            if detail:
                out = (root, {n: self._info(ds, e) for n, e in dirs.items()},
                       {n: self._info(ds, e) for n, e in files.items()})
            else:
                out = (root, list(dirs), list(files))
            if topdown:
                yield out
            if maxdepth is None or depth < maxdepth:
                stack.extend((e.path, depth + 1) for e in reversed(list(dirs.values())))
            if not topdown:
                yield out

    def find(self, path, maxdepth=None, withdirs=False, detail=False, **kwargs):
        """Every file (and, with ``withdirs``, directory) under ``path``, from the manifest."""
        out = {}
        for _root, dirs, files in self.walk(path, maxdepth, detail=True):
            if withdirs:
                out.update({info["name"]: info for info in dirs.values()})
            out.update({info["name"]: info for info in files.values()})
        if not out and self.isfile(path):
            out = {self._strip_protocol(path): self.info(path)}
        names = sorted(out)
        return {n: out[n] for n in names} if detail else names

    def info(self, path, **kwargs):
        if self.writable:
            local = self.writes.local(self._url(path)) or self.writes.local_dir(self._url(path))
            if local is not None:
                return _local_info(self._strip_protocol(path), local)
        ds, rel = self._resolve(path, as_dir=False)
        return self._info(ds, ds.stat(rel))

    def cat_file(self, path, start=None, end=None, **kwargs):
        local = self.writes.local(self._url(path)) if self.writable else None
        if local is not None:
            with open(local, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                start, end = norm_range(size, start, end)
                return os.pread(f.fileno(), end - start, start)
        ds, rel = self._resolve(path, as_dir=False)
        entry = ds.file(rel)
        start, end = norm_range(entry.size, start, end)
        return read_range(self.engine, ds, entry, start, end)

    def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None, **kwargs):
        if "r" not in mode or any(c in mode for c in "wax+"):
            if not self.writable:
                raise ReadOnlyError(f"{path}: cachefs is read-only (mode {mode!r}; cachefs={{'writable': True}} "
                                    "writes)")
            return self.writes.open(self._url(path), mode)
        local = self.writes.local(self._url(path)) if self.writable else None
        if local is not None:
            return open(local, "rb")
        ds, rel = self._resolve(path, as_dir=False)
        return CacheFile(self, ds, ds.file(rel))

    def ukey(self, path):
        return self.info(path).get("ETag", "")

    def modified(self, path):
        import datetime

        return datetime.datetime.fromtimestamp(self.info(path)["mtime"], tz=datetime.UTC)

    # -- writes (writable=True) -----------------------------------------------------------------------------
    def rm_file(self, path):
        self.writes.remove(self._url(path))

    def rm(self, path, recursive=False, maxdepth=None):
        for p in path if isinstance(path, list) else [path]:
            self.writes.remove(self._url(p), recursive=recursive)

    def mv(self, path1, path2, recursive=False, maxdepth=None, **kwargs):
        self.writes.move(self._url(path1), self._url(path2))

    def mkdir(self, path, create_parents=True, **kwargs):
        self.writes.mkdir(self._url(path))

    def makedirs(self, path, exist_ok=False):
        self.writes.mkdir(self._url(path))

    def rmdir(self, path):
        local = self.writes.local_dir(self._url(path))
        if local is not None:
            os.rmdir(local)

    def cp_file(self, path1, path2, **kwargs):
        with self.open(path1, "rb") as src, self.open(path2, "wb") as dst:
            shutil.copyfileobj(src, dst, 4 * 1024 * 1024)

    # put_file is fsspec's: open(…, "wb") and write.
    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        with self.open(path, "wb") as f:
            f.write(value)

    def touch(self, path, truncate=True, **kwargs):
        if truncate or not self.exists(path):
            with self.open(path, "wb"):
                pass


def _local_info(name: str, local: str) -> dict[str, Any]:
    st = os.stat(local)
    is_dir = os.path.isdir(local)
    return {"name": name, "size": 0 if is_dir else st.st_size, "type": "directory" if is_dir else "file",
            "mtime": st.st_mtime}


def _merge_listings(fs: CacheFileSystem, path: str, detail: bool):
    """A writable filesystem's listing: the origin's (through the read path) and what this process wrote."""
    out: dict[str, dict[str, Any]] = {}
    try:
        out.update({i["name"]: i for i in fs._ls_read(path, True)})
    except FileNotFoundError:
        pass
    local = fs.writes.local_dir(fs._url(path))
    base = fs._strip_protocol(path).rstrip("/")
    if local is not None:
        for name in sorted(os.listdir(local)):
            out[f"{base}/{name}"] = _local_info(f"{base}/{name}", os.path.join(local, name))
    if not out:
        raise FileNotFoundError(2, "No such file or directory", path)
    infos = [out[k] for k in sorted(out)]
    return infos if detail else [i["name"] for i in infos]


def _layer_options(target_protocol: str | None, target_options: dict[str, Any] | None, options: dict[str, Any],
                   ) -> tuple[str | None, dict[str, Any], dict[str, dict[str, Any]], dict[str, Any]]:
    """The same options mean the same thing in every URL form a loader may hand us.

    ``{"cachefs": {...}, "s3": {...}}`` is what a chained ``cachefs::s3://`` URL takes. Given to a single-hop
    ``cachefs://bucket/key`` (loaders that split URLs on ``::`` themselves, such as webdataset and HF datasets'
    streaming, take only those), the ``cachefs`` part is ours and a part named after a protocol is that origin's,
    nested in ours or beside it. Returns the target protocol (None: decided per path), the options for any
    origin, the options per origin protocol, and ours.
    """
    options = dict(options)
    nested = options.pop("cachefs", None)
    if isinstance(nested, dict):
        nested = dict(nested)
        target_protocol = target_protocol or nested.pop("target_protocol", None)
        target_options = {**(nested.pop("target_options", None) or {}), **(target_options or {})}
        options = {**nested, **options}
    target_options = dict(target_options or {})
    if "target_options" in target_options or "target_protocol" in target_options:
        # Our own storage_options filed under the origin's protocol: HF datasets does this when it resolves a
        # chained glob and opens the files it found. The origin's options are the ones nested inside.
        refiled = target_options
        target_options = dict(refiled.get("target_options") or {})
        target_protocol = target_protocol or refiled.get("target_protocol")
        for key, value in refiled.items():
            if key not in ("target_options", "target_protocol", "fo"):
                options.setdefault(key, value)
    protocols = _origin_protocols()
    layers = {k: options.pop(k) for k in [k for k, v in options.items() if isinstance(v, dict) and k in protocols]}
    if target_protocol is None and len(layers) == 1:
        target_protocol = next(iter(layers))
    return target_protocol, target_options, layers, options


def _origin_protocols() -> set[str]:
    import fsspec

    return set(fsspec.available_protocols()) - {"cachefs"}
