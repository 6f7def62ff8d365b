"""The versioned model repository on disk: what it holds, and which versions a policy picks.

Owns: the layout of a model repository and reading it — model names, version numbers,
each version's ModelConfig — the version policy's choice among a model's versions
(``select``), and the rule that no path used leaves the repository.

Layout (issue 12; ``server.model_repository`` / ``serve --model-repository``)::

    DIR/<model>/config.toml         the keys of one [[models]] table, at the top level; ``name``
                                    optional (the directory's name; if given, equal to it); ``path``
                                    the model file's name inside each version directory (python:
                                    ``module:callable``, the module in the version directory)
    DIR/<model>/<version>/<file>    version: a positive integer without leading zeros

Other entries are ignored: hidden ones, plain files, and directories whose names are not
versions (those that look like one, such as ``01`` or ``0``, are listed in ``skipped``).

Trust: whoever can write the repository chooses the models, but no path the server uses may
leave it.  Model names follow config's rule and never hold ``/`` or ``..``; ``path`` and
``warmup.inputs`` are relative, with no ``..`` component; and every path used (model directory,
config.toml, version directory, model file, warm-up file) has its ``os.path.realpath`` inside
``realpath(DIR)`` — a symlink within the repository is fine, one out of it is refused with
PERMISSION_DENIED, and the message says "leaves the repository", never where it points.
config.toml is opened without following a final symlink or blocking, must be a regular file,
and at most ``MAX_CONFIG_BYTES``.  Checks are made when the repository is read: whoever
replaces files afterwards races the worker's own open, as with any config.

Errors: ``RepositoryError`` carries UNKNOWN_MODEL (no such model or version), PERMISSION_DENIED
(a path leaves the repository), BAD_ARGUMENT (a malformed model name or version number, or a
config.toml whose content is wrong: not UTF-8 TOML, an unknown key or a bad value, named in the
message) or MODEL_UNAVAILABLE (the files are not there to be used: config.toml missing, not a
regular file or too large, a version that is not a directory or lacks its model file).
``scan`` records them per model and per version and never raises for one bad model.

Must not: start processes, import asyncio or a backend, or keep state: every call reads the
file system afresh (the caller decides when to look again).
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path

from shmserve.config import ConfigError, ModelConfig, _model
from shmserve.errors import ErrorCode, ShmserveError

CONFIG_FILE = "config.toml"
MAX_CONFIG_BYTES = 1 << 20  # a [[models]] table is a few hundred bytes; 1 MiB bounds what a scan reads
MAX_VERSION = 2**31 - 1  # the bound config puts on version_policy's versions
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")  # config's rule for a model name
_VERSION_RE = re.compile(r"^[1-9][0-9]*$")
_DIGITS_RE = re.compile(r"^[0-9]+$")
LEAVES = "leaves the repository"


class RepositoryError(ShmserveError):
    """A repository lookup failed; ``code`` says why (module docstring)."""


@dataclass(frozen=True)
class VersionEntry:
    version: int
    config: ModelConfig | None  # loadable: its config (``version`` and absolute paths filled in)
    error: str | None  # else why not


@dataclass(frozen=True)
class RepoModel:
    name: str
    versions: tuple[VersionEntry, ...] = ()  # every version directory found, ascending
    selected: tuple[int, ...] = ()  # what the version policy picks among the loadable versions
    error: str | None = None  # config.toml unreadable, invalid or leaving the repository: no version is loadable
    template: ModelConfig | None = None  # config.toml as parsed (path as written, base_dir ""), None on error
    missing: tuple[int, ...] = ()  # versions the policy lists by number that have no directory
    skipped: tuple[str, ...] = ()  # entries that look like versions but are not ("0", "01")


def select(policy: tuple[str, tuple[int, ...]], available: tuple[int, ...]) -> tuple[int, ...]:
    """The versions ``policy`` (ModelConfig.version_policy) picks from ``available``, ascending:
    ("latest", (n,)) the n highest, ("all", ()) every one, ("specific", vs) those of vs present
    (a listed version not available is not picked).  ValueError for an unknown policy kind."""
    ordered = tuple(sorted(set(available)))
    kind, args = policy
    if kind == "latest":
        return ordered[-args[0]:] if args[0] > 0 else ()
    if kind == "all":
        return ordered
    if kind == "specific":
        return tuple(v for v in ordered if v in args)
    raise ValueError(f"unknown version policy {kind!r}")


def scan(root: str) -> dict[str, RepoModel]:
    """Every model directory of the repository ``root``, by name (sorted), each with its versions.
    A broken model or version is reported in its entry (``error``), never raised.  RepositoryError
    UNKNOWN_MODEL only when ``root`` itself is not a readable directory."""
    real_root = _real_root(root)
    try:
        names = sorted(os.listdir(real_root))
    except OSError as exc:
        raise RepositoryError(ErrorCode.UNKNOWN_MODEL, f"model repository: {exc.strerror}") from None
    models = {}
    for name in names:
        if name.startswith(".") or not os.path.isdir(os.path.join(real_root, name)):
            continue
        models[name] = _read_model(real_root, name)
    return models


def version_config(root: str, model: str, version: int | None = None) -> ModelConfig:
    """The config of one loadable version of ``model``: ``version``, which the policy need not
    select (an explicit load), else the newest version the policy selects.  RepositoryError:
    BAD_ARGUMENT (malformed name or version), UNKNOWN_MODEL (no such model or version, or the
    policy selects none), PERMISSION_DENIED (a path leaves the repository), MODEL_UNAVAILABLE
    (config.toml or that version is broken)."""
    if version is not None and (type(version) is not int or not 1 <= version <= MAX_VERSION):
        raise RepositoryError(ErrorCode.BAD_ARGUMENT,
                              f"version: expected an integer in [1, {MAX_VERSION}], got {version!r}")
    real_root = _real_root(root)
    _check_name(model)
    if not os.path.isdir(os.path.join(real_root, model)):
        raise RepositoryError(ErrorCode.UNKNOWN_MODEL, f"no model {model!r} in the repository")
    model_dir, raw, template = _template(real_root, model)
    if version is None:
        versions = _versions(model_dir)[0]
        loadable = []
        for v in versions:
            try:
                loadable.append(_version(real_root, model_dir, model, raw, template, v))
            except RepositoryError:
                continue
        chosen = select(template.version_policy, tuple(c.version for c in loadable))
        if not chosen:
            raise RepositoryError(ErrorCode.UNKNOWN_MODEL,
                                  f"model {model!r}: its version_policy selects no loadable version")
        return next(c for c in loadable if c.version == chosen[-1])
    if not os.path.lexists(os.path.join(model_dir, str(version))):
        raise RepositoryError(ErrorCode.UNKNOWN_MODEL, f"model {model!r} has no version {version}")
    return _version(real_root, model_dir, model, raw, template, version)


# -- reading one model -------------------------------------------------------------------------

def _read_model(real_root: str, name: str) -> RepoModel:
    """``scan``'s entry for the directory ``name`` (which exists)."""
    try:
        _check_name(name)
        model_dir, raw, template = _template(real_root, name)
    except RepositoryError as exc:
        return RepoModel(name=name, error=exc.message)
    versions, skipped = _versions(model_dir)
    entries = []
    for v in versions:
        try:
            entries.append(VersionEntry(v, _version(real_root, model_dir, name, raw, template, v), None))
        except RepositoryError as exc:
            entries.append(VersionEntry(v, None, exc.message))
    selected = select(template.version_policy, tuple(e.version for e in entries if e.config is not None))
    kind, listed = template.version_policy
    missing = tuple(v for v in listed if v not in versions) if kind == "specific" else ()
    return RepoModel(name=name, versions=tuple(entries), selected=selected, template=template,
                     missing=missing, skipped=skipped)


def _template(real_root: str, name: str) -> tuple[str, dict, ModelConfig]:
    """The model directory's real path, config.toml's table (with ``name``) and its parse.
    RepositoryError: PERMISSION_DENIED (the directory, config.toml, ``path`` or a warm-up file
    leaves the repository), BAD_ARGUMENT (config.toml's content is wrong), MODEL_UNAVAILABLE
    (config.toml missing, not a regular file or too large)."""
    model_dir = _inside(real_root, os.path.join(real_root, name), f"model {name!r}")
    where = f"{name}/{CONFIG_FILE}"
    config_path = _inside(real_root, os.path.join(model_dir, CONFIG_FILE), f"model {name!r}: {CONFIG_FILE}")
    raw = _read_config(config_path, where)
    if "name" in raw and raw["name"] != name:
        raise RepositoryError(ErrorCode.BAD_ARGUMENT,
                              f"{where}.name: {raw['name']!r} differs from the directory's name {name!r}")
    raw = {**raw, "name": name}
    try:
        template = _model(raw, where, None)
    except ConfigError as exc:
        raise RepositoryError(ErrorCode.BAD_ARGUMENT, str(exc)) from None
    if template.backend != "python":
        _relative(template.path, f"{where}.path")
    for input_name, file in template.warmup_inputs:
        _relative(file, f"{where}.warmup.inputs.{input_name}")
    return model_dir, raw, template


def _read_config(path: str, where: str) -> dict:
    """config.toml's table: a regular file of at most MAX_CONFIG_BYTES, opened without following
    a final symlink or blocking (a FIFO).  RepositoryError MODEL_UNAVAILABLE otherwise, BAD_ARGUMENT
    for content that is not UTF-8 TOML."""
    def bad(why: str, code: ErrorCode = ErrorCode.MODEL_UNAVAILABLE) -> RepositoryError:
        return RepositoryError(code, f"{where}: {why}")

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise bad(exc.strerror or "cannot be opened") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise bad("not a regular file")
        if st.st_size > MAX_CONFIG_BYTES:
            raise bad(f"larger than {MAX_CONFIG_BYTES} bytes")
        data = os.read(fd, MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise bad(exc.strerror or "cannot be read") from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise bad(f"larger than {MAX_CONFIG_BYTES} bytes")
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise bad("not UTF-8 text", ErrorCode.BAD_ARGUMENT) from None
    except tomllib.TOMLDecodeError as exc:
        raise bad(f"not valid TOML: {exc}", ErrorCode.BAD_ARGUMENT) from None


def _versions(model_dir: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The version numbers among the model directory's entries, ascending, and the entries that
    look like versions but are not (``0``, ``01``, beyond MAX_VERSION), sorted.  An unreadable
    directory has none."""
    try:
        names = os.listdir(model_dir)
    except OSError:
        return (), ()
    versions, skipped = [], []
    for entry in names:
        if _VERSION_RE.match(entry) and int(entry) <= MAX_VERSION:
            versions.append(int(entry))
        elif _DIGITS_RE.match(entry):
            skipped.append(entry)
    return tuple(sorted(versions)), tuple(sorted(skipped))


def _version(real_root: str, model_dir: str, name: str, raw: dict, template: ModelConfig,
             version: int) -> ModelConfig:
    """The config of version ``version`` (whose entry exists) with its files found in its
    directory.  RepositoryError PERMISSION_DENIED (the directory, model file or a warm-up file
    leaves the repository), MODEL_UNAVAILABLE (not a directory, no model file, invalid)."""
    what = f"model {name!r} version {version}"
    version_dir = _inside(real_root, os.path.join(model_dir, str(version)), what)
    if not os.path.isdir(version_dir):
        raise RepositoryError(ErrorCode.MODEL_UNAVAILABLE, f"{what}: not a directory")
    if template.backend == "python":
        top = template.path.partition(":")[0].split(".")[0]
        candidates = [os.path.join(version_dir, f"{top}.py"), os.path.join(version_dir, top)]
        found = [c for c in candidates if os.path.lexists(c)]
        if not found:
            raise RepositoryError(ErrorCode.MODEL_UNAVAILABLE,
                                  f"{what}: no module {top!r} ({top}.py or {top}/) in the version directory")
        for c in found:
            _inside(real_root, c, what)
        model_file = None
    else:
        model_file = _inside(real_root, os.path.join(version_dir, template.path), what)
        if not os.path.isfile(model_file):
            raise RepositoryError(ErrorCode.MODEL_UNAVAILABLE,
                                  f"{what}: no model file {template.path!r} (path) in the version directory")
    for _, file in template.warmup_inputs:
        _inside(real_root, os.path.join(version_dir, file), what)
    try:
        config = _model(raw, f"{name}/{version}", Path(version_dir))
    except ConfigError as exc:
        raise RepositoryError(ErrorCode.MODEL_UNAVAILABLE, str(exc)) from None
    changes = {"version": version} if model_file is None else {"version": version, "path": model_file}
    return dataclasses.replace(config, **changes)


# -- names and paths -----------------------------------------------------------------------------

def _real_root(root: str) -> str:
    real = os.path.realpath(root)
    if not os.path.isdir(real):
        raise RepositoryError(ErrorCode.UNKNOWN_MODEL, f"model repository: no such directory {root!r}")
    return real


def _check_name(name) -> None:
    """RepositoryError BAD_ARGUMENT unless ``name`` is a model name (config's rule, no ``..``,
    not hidden): a name can never make a path."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or ".." in name or name.startswith("."):
        raise RepositoryError(ErrorCode.BAD_ARGUMENT,
                              f"model name {name!r}: must be 1-128 of A-Z a-z 0-9 _ . : -, "
                              f"not starting with '.' nor holding '..'")


def _relative(path: str, where: str) -> None:
    """RepositoryError PERMISSION_DENIED unless ``path`` is relative with no ``..`` component."""
    if os.path.isabs(path) or ".." in Path(path).parts:
        raise RepositoryError(ErrorCode.PERMISSION_DENIED,
                              f"{where}: {LEAVES} (a file inside the version directory: relative, no '..')")


def _inside(real_root: str, path: str, what: str) -> str:
    """``path``'s realpath, which must lie inside ``real_root`` (below it, not it); else RepositoryError
    PERMISSION_DENIED naming ``what`` only (never where the path points)."""
    real = os.path.realpath(path)
    if not real.startswith(real_root.rstrip(os.sep) + os.sep):
        raise RepositoryError(ErrorCode.PERMISSION_DENIED, f"{what}: {LEAVES}")
    return real
