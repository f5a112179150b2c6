"""Where a model is read from, and the line when it cannot be: a local folder (a file in it this process may not
read, a config.json that is no JSON object, a JSON or safetensors file that does not parse, weights only as a pickle
where safetensors are asked for: each named as such, not as what transformers makes of it) or a Hub id (with the Hub
out of reach, read from the Hub cache alone at once, not after huggingface_hub's retries: draftsmith/hub_cache.py).
The target's loads (draftsmith/target.py) and a released assistant's (heads/gemma4_assistant.py) go through it."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Optional

from safetensors import safe_open

from draftsmith.errors import HubUnavailable, UserError, hub_cache_miss, one_line
from draftsmith.hub_cache import cached_commits, hub_folder, hub_out_of_reach, hub_snapshot, not_cached, unreachable

SAFETENSORS_INDEX = "model.safetensors.index.json"

# Every model draftsmith loads with `from_pretrained` runs transformers' own layers. Since transformers 5.25 a load
# kernelizes the model by default (use_kernels): matching layers are replaced by kernels the `kernels` package
# fetches from the Hub (compiled code from outside the release, like remote code; on a machine that cannot reach the
# Hub, a failed load). The trainer's fused layers come from torch.compile instead (train.compile_target).
TRANSFORMERS_LAYERS = {"use_kernels": False}


def read_pretrained(load: Callable[..., Any], name_or_path: str, what: str, **kwargs) -> Any:
    """`load(name_or_path, **kwargs)`, a transformers `from_pretrained`: from the Hub cache alone while the Hub is
    out of reach (`hub_out_of_reach`); a local folder's files checked first (`check_local_files`); a model that does
    not load is one line starting with `what` (`not_loadable`)."""
    from huggingface_hub.errors import StrictDataclassError
    from safetensors import SafetensorError

    folder = Path(name_or_path).expanduser()
    if folder.is_dir():
        check_local_files(folder, what, safetensors_only=kwargs.get("use_safetensors", False))
    out_of_reach = hub_out_of_reach(name_or_path)
    if out_of_reach is not None:
        kwargs["local_files_only"] = True
        # a model's load: transformers does not hand local_files_only on to its look for a PEFT adapter's config
        if "adapter_kwargs" in kwargs:
            kwargs["adapter_kwargs"] = {**kwargs["adapter_kwargs"], "local_files_only": True}
    try:
        return load(name_or_path, **kwargs)
    # StrictDataclassError: a config its class's own checks refuse (per-layer lists longer than num_hidden_layers)
    except (OSError, ValueError, SafetensorError, StrictDataclassError) as err:
        line = not_loadable(
            what, err, name_or_path, out_of_reach, kwargs.get("use_safetensors", False), kwargs.get("revision")
        )
        if not mistyped_folder(name_or_path):
            raise line from err
    except RuntimeError as err:  # transformers' words for weights of other shapes than the config gives them
        if "ignore_mismatched_sizes" not in str(err) and "size mismatch" not in str(err):
            raise
        raise UserError(
            f"{what}: its weights' shapes are not those its config.json gives them (transformers' load report, "
            "logged above, lists them): a config.json edited, or of another model"
        ) from err
    # a path mistyped beside a folder whose name is close, raised outside the handler so that no failed request is in
    # its chain: bad input (exit 2), not the Hub out of reach (exit 69, "run it again", which a scheduler does forever)
    raise line


# the files a saved tokenizer holds (save_pretrained writes both; formats/repo.py TOKENIZER_FILES: all an export copies)
SAVED_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def read_tokenizer(load: Callable[..., Any], name_or_path: str, what: str, **kwargs) -> Any:
    """`read_pretrained` for a tokenizer: a local folder without its files is named as such (transformers then tries
    to build one from a slow tokenizer's files, and says to install sentencepiece or tiktoken), and so is a
    tokenizer.json that is JSON but no tokenizer, which transformers reads with a KeyError ('added_tokens'), a
    TypeError or an AttributeError (exit 70): named where the tokenizers library refuses the file too, the loader's
    error raised as it is otherwise (a bug, not the file)."""
    folder = Path(name_or_path).expanduser()
    try:
        return read_pretrained(load, name_or_path, what, **kwargs)
    except UserError as err:
        where = folder if folder.is_dir() else hub_snapshot(name_or_path, kwargs.get("revision"))  # a Hub id's cached
        if where is not None and not any((where / name).is_file() for name in SAVED_TOKENIZER_FILES):
            said = "the folder" if where == folder else f"the Hub cache's copy of it ({where})"
            advice = "" if where == folder else ": download them once with a network, or give a local folder"
            raise UserError(f"{what}: {said} holds no {' or '.join(SAVED_TOKENIZER_FILES)}{advice}") from err
        raise
    except Exception as err:
        refused = not_a_tokenizer(folder / "tokenizer.json") if folder.is_dir() else None
        if refused is None:
            raise
        raise UserError(f"{what}: {folder / 'tokenizer.json'} is not a tokenizer ({refused})") from err


def not_a_tokenizer(path: Path) -> Optional[str]:
    """Why the tokenizers library refuses `path` as a tokenizer (its line names the key and the place in the file),
    or None where it reads it (or there is no such file)."""
    from tokenizers import Tokenizer

    if not path.is_file():
        return None
    try:
        Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - the library raises a plain Exception for a file it cannot read
        return one_line(err)
    return None


# transformers' names of weights stored as a pickle (a single file, or the shards an index lists)
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
# and as safetensors, what a load with use_safetensors reads: shards without their index are not read, nor another
# *.safetensors beside them (an extra head's)
SAFETENSORS_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
# what to do with weights draftsmith does not read
CONVERT_PICKLE = (
    "which draftsmith does not load (unpickling a file can run code it holds): convert them to safetensors where you "
    "trust them (in transformers, from_pretrained then save_pretrained writes model.safetensors)"
)


# the JSON files of settings transformers reads from a model's folder, each an object
SETTINGS_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json")


def check_local_files(folder: Path, what: str, safetensors_only: bool) -> None:
    """Refuse, in one line naming the file, what transformers would fail on without naming it: a file of settings
    (SETTINGS_FILES) that holds no JSON object (a list read as a config is a TypeError); with `safetensors_only`,
    weights stored only as a pickle, which draftsmith never unpickles (unpickling a file can run code it holds)."""
    for settings in (folder / name for name in SETTINGS_FILES):
        try:
            values = json.loads(settings.read_text()) if settings.is_file() else {}
        except ValueError as err:  # transformers skips a generation_config.json it cannot parse: its stop ids with it
            raise UserError(f"{what}: {settings} is not valid JSON ({one_line(err)})") from None
        except OSError:  # unreadable: not_loadable names it
            values = {}
        if not isinstance(values, dict):
            raise UserError(f"{what}: {settings} holds a JSON {type(values).__name__}, not an object of settings")
    pickled = [folder / name for name in PICKLED_WEIGHTS if (folder / name).is_file()]
    if safetensors_only and pickled and not any((folder / name).is_file() for name in SAFETENSORS_WEIGHTS):
        raise UserError(f"{what}: its weights are a pickle ({pickled[0]}), {CONVERT_PICKLE}")


def not_loadable(
    what: str,
    err: BaseException,
    name_or_path: str,
    out_of_reach: Optional[Exception] = None,
    safetensors_only: bool = False,
    revision: Optional[str] = None,
) -> UserError | HubUnavailable:
    """The line for a model that did not load: transformers' reason; for a local folder it cannot read, the file
    (transformers names another cause: "No such file or directory" for unreadable weights, "Should have a
    `model_type` key" for an unreadable folder), the safetensors or JSON file that does not parse (their parsers
    name none); a folder's custom code without trust in draftsmith's words (transformers' names the folder as a Hub
    URL, and the keyword argument, not the recipe key); for a Hub id not in the cache with HF_HUB_OFFLINE=1, that
    (transformers' own line then says it could not connect, which it never tried) and the cached id closest to it; a
    Hub repo cached without weights, that (HubUnavailable, exit 69, where the Hub is out of reach: the same command
    downloads them once it answers); a Hub repo without safetensors
    weights, read with `safetensors_only` (use_safetensors), as a local folder's pickle is (transformers' line says
    not to set use_safetensors, which draftsmith always sets). Raised from `err`, whose chain says whether the Hub
    was out of reach instead (errors.hub_unreachable); `out_of_reach` is the failed probe's error of a load that
    read the cache alone (`hub_out_of_reach`)."""
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import StrictDataclassError
    from safetensors import SafetensorError

    what += read_as_hub_id(name_or_path)
    miss = hub_cache_miss(err)
    if constants.HF_HUB_OFFLINE and miss is not None:  # offline, no request was made
        cached = cached_commits(name_or_path)
        if revision is not None and cached:  # the repository is there, that revision of it is not
            return UserError(
                f"{what}: revision {revision} is not in the Hub cache ({constants.HF_HUB_CACHE}), which holds "
                f"{cached} of it, and HF_HUB_OFFLINE=1 forbids downloading it: give one of those as target.revision, "
                "or download it once with a network"
            )
        return not_cached(what, name_or_path, guess=not read_as_hub_id(name_or_path))
    if miss is not None and out_of_reach is not None and miss.__cause__ is None:
        # the request that failed was the probe's: chained as huggingface_hub chains its own, the miss reads as the
        # Hub out of reach (exit 69), not as bad input
        miss.__cause__ = out_of_reach
    folder = Path(name_or_path).expanduser()
    local = folder.is_dir()
    cache_alone = constants.HF_HUB_OFFLINE or out_of_reach is not None
    if safetensors_only and not local and cache_alone:

        def cached(name: str) -> bool:
            return isinstance(try_to_load_from_cache(name_or_path, name, revision=revision), str)

        if cached("config.json") and not any(map(cached, (*SAFETENSORS_WEIGHTS, *PICKLED_WEIGHTS))):
            weights = " or ".join(SAFETENSORS_WEIGHTS)
            no_weights = f"{what}: the Hub cache ({constants.HF_HUB_CACHE}) holds no weights of it ({weights})"
            if out_of_reach is not None:  # the same command downloads them once the Hub answers: retry, not input
                return unreachable(f"{no_weights}, and the Hub", out_of_reach, " to download them")
            return UserError(f"{no_weights}: download them once with a network, or give a local folder")
    if safetensors_only and not local and "use_safetensors" in str(err):
        where = " in the Hub cache" if cache_alone else ""
        return UserError(
            f"{what}: its weights are not safetensors ({name_or_path} has no {' or '.join(SAFETENSORS_WEIGHTS)}"
            f"{where}): a pickle (pytorch_model.bin), {CONVERT_PICKLE}"
        )
    unreadable = first_unreadable(folder) if local else None
    if unreadable is not None and failed_on(err, unreadable):
        return UserError(f"{what}: cannot read {unreadable}: permission denied")
    if "trust_remote_code" in str(err):  # transformers' line names the argument, and the folder as a Hub URL
        return UserError(
            f"{what}: its config asks to run code of its own (auto_map), which draftsmith runs only with "
            "target.trust_remote_code=true: read that code, then set it"
        )
    if chained(err, StrictDataclassError):  # a config class's own checks, whatever loads it (a tokenizer reads it too)
        return UserError(f"{what}: transformers refuses its config.json ({one_line(err)})")
    if chained(err, SafetensorError):  # safetensors' line names no file
        corrupt = first_unparsed(folder, "*.safetensors", safetensors_header) if local else None
        return UserError(
            f"{what}: {corrupt[0] if corrupt else 'a weights file'}: corrupt weights file ({one_line(err)})"
        )
    if chained(err, json.JSONDecodeError):  # a tokenizer's or a config's JSON cut short: the line names no file
        malformed = first_unparsed(folder, "*.json", lambda path: json.loads(path.read_text())) if local else None
        if malformed is not None:
            return UserError(f"{what}: {malformed[0]} is not valid JSON ({one_line(malformed[1])})")
    return UserError(f"{what}: {one_line(err)}")


def read_as_hub_id(name_or_path: str) -> str:
    """What to add to a load's line where `name_or_path` is no folder but its first part is one here: a local path
    mistyped, read as the Hub id owner/name (offline, or asked of the Hub, it failed as a Hub id); the closest
    folder there, where one is close."""
    folder = beside_a_folder(name_or_path)
    if folder is None:
        return ""
    close = mistyped_folder(name_or_path)
    said = f": did you mean {close}?" if close else ""
    return f" (read as a Hub id: the folder {folder.parent} here has no {folder.name}{said})"


def beside_a_folder(name_or_path: str) -> Optional[Path]:
    """`name_or_path` as a path, where it is no folder but its first part is one here; else None."""
    folder = Path(name_or_path).expanduser()
    return None if folder.is_dir() or folder.parent == Path(".") or not folder.parent.is_dir() else folder


def mistyped_folder(name_or_path: str) -> Optional[Path]:
    """The folder beside `name_or_path` whose name is close to its own (a local path mistyped), else None."""
    import difflib

    folder = beside_a_folder(name_or_path)
    if folder is None:
        return None
    names = [entry.name for entry in folder.parent.iterdir() if entry.is_dir()]
    close = difflib.get_close_matches(folder.name, names, n=1)
    return folder.parent / close[0] if close else None


def chained(err: BaseException, kind: type) -> bool:
    """Whether `err` or an error it was raised from or while handling is a `kind`."""
    link: Optional[BaseException] = err
    while link is not None:
        if isinstance(link, kind):
            return True
        link = link.__cause__ or link.__context__
    return False


def safetensors_header(path: Path) -> None:
    """Parse a safetensors file's header (which also checks that it covers the file); raises SafetensorError."""
    from safetensors import safe_open

    with safe_open(path, framework="pt"):
        pass


def first_unparsed(folder: Path, pattern: str, parse: Callable[[Path], Any]) -> Optional[tuple[Path, Exception]]:
    """The first file in `folder` matching `pattern` that `parse` fails on, with the parser's error; or None."""
    for path in sorted(folder.glob(pattern)):
        try:
            parse(path)
        except Exception as err:  # noqa: BLE001 - whatever the parser raises, the file is the one that does not parse
            return path, err
    return None


def failed_on(err: BaseException, unreadable: Path) -> bool:
    """Whether the unreadable file or folder is why `err` was raised: a PermissionError in its chain, or a link
    naming it (a tokenizer that fails for its own reason beside unreadable weights is not failing on them)."""
    link: Optional[BaseException] = err
    while link is not None:
        if isinstance(link, PermissionError) or str(unreadable) in str(link):
            return True
        link = link.__cause__ or link.__context__
    return False


def first_unreadable(folder: Path) -> Optional[Path]:
    """The first folder or file under `folder` (itself included) that this process may not read, or None."""
    denied: list[str] = []

    def listing_failed(err: OSError) -> None:
        if isinstance(err, PermissionError):
            denied.append(err.filename)

    for parent, _, files in os.walk(folder, onerror=listing_failed):
        if denied:
            break
        for name in sorted(files):
            try:
                with open(os.path.join(parent, name), "rb"):
                    pass
            except PermissionError:
                return Path(parent, name)
    return Path(denied[0]) if denied else None


def tensor_names(folder: Path) -> Mapping[str, Path]:
    """Tensor name -> the safetensors file of a checkpoint folder that holds it (headers only). Read once per
    checkpoint as its files stand (their sizes and times name it): an MTP start asks three times (the recipe's
    check, the drafter's own when it is built, reading the layer), and a release's index or headers are megabytes."""
    index = folder / SAFETENSORS_INDEX
    files = (index,) if index.is_file() else tuple(sorted(folder.glob("*.safetensors")))
    return names_in(tuple((path, stat.st_mtime_ns, stat.st_size) for path in files for stat in [path.stat()]))


def stored_name(name: str, stored: Mapping[str, Path]) -> Optional[str]:
    """The name under which a checkpoint (`stored`: `tensor_names`) holds a model's tensor `name`: itself, or where a
    wrapper's release stores its language model under a prefix of its own (`language_model.model.layers.*`,
    `model.language_model.layers.*`, for the `model.layers.*` of the causal LM loaded from it) the one stored name that
    ends in the longest tail of `name` (two parts at least) any stored name ends in, of several the one in a
    `language_model`; None where none does, or several do alike."""
    if name in stored:
        return name
    parts = name.split(".")
    for start in range(len(parts) - 1):
        tail = "." + ".".join(parts[start:])
        found = [key for key in stored if key.endswith(tail)]
        if len(found) > 1:
            found = [key for key in found if "language_model" in key.split(".")]
            return found[0] if len(found) == 1 else None
        if found:
            return found[0]
    return None


@functools.lru_cache(maxsize=4)
def names_in(stamped: tuple[tuple[Path, int, int], ...]) -> Mapping[str, Path]:
    """`tensor_names` of a folder's index or its safetensors files (`stamped`: each with its time and size), read-only
    as every caller shares it."""
    names: dict[str, Path] = {}
    for path, _, _ in stamped:
        if path.name == SAFETENSORS_INDEX:
            stored = json.loads(path.read_text())["weight_map"]
            names.update({name: path.parent / file for name, file in stored.items()})
        else:
            with safe_open(str(path), "pt") as f:
                names.update(dict.fromkeys(f.keys(), path))
    return MappingProxyType(names)


def checkpoint_folder(name_or_path: str, reader: str, revision: Optional[str] = None) -> Path:
    """The target's checkpoint folder: a local one, or a Hub id's snapshot at `revision` (the commit the target was
    loaded from: TargetShape.revision) in the cache (its weights fetched when the target loaded, or by the engine that
    runs it). `reader` names what reads it, for the line when it cannot."""
    return hub_folder(name_or_path, f"{reader}: cannot read target {name_or_path!r}'s checkpoint", revision)


def prefix_renamed(name: str, renames: Iterable[tuple[str, str]]) -> str:
    """A tensor's name with its leading module renamed by the first (from, to) pair it starts with (a layout's names
    to another's)."""
    for old, new in renames:
        if name.startswith(old):
            return new + name.removeprefix(old)
    return name
