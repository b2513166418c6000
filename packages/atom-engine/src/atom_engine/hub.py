"""Where the model comes from: a local checkpoint, the bundled default, or a Hugging Face Hub ID
resolved to a local snapshot directory by `huggingface_hub` (its cache, progress bars and
resumed downloads; it reads HF_TOKEN, HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE and HF_ENDPOINT).

The engine resolves once, in `EngineFront`, before any worker or replica process starts; those
processes get the local path. Only what ATOM loads is downloaded: the config, generation config,
tokenizer files and chat template, the checkpoint's own code (for `trust_remote_code`) and the
top-level safetensors the index names — or just the one `.gguf` file asked for.

Standalone on purpose (the standard library, and huggingface_hub imported when a Hub ID is
resolved): the tests run it in fresh interpreters with the HF_* variables of each case.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger("atom_engine")

# Everything a checkpoint directory holds besides its weights, at the top level (`*/*` is
# ignored: ATOM reads no subfolder, and `original/` copies of the weights are large).
NON_WEIGHT_PATTERNS = ["*.json", "*.jinja", "*.model", "*.tiktoken", "*.txt", "*.py"]
TOP_LEVEL_ONLY = ["*/*"]
INDEX = "model.safetensors.index.json"


class ModelNotFoundError(ValueError):
    """The model (or tokenizer) named cannot be had: the message says why and what to do."""


def resolve_model(
    model: str | None,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    gguf_file: str | None = None,
    weights: bool = True,
) -> str:
    """The local path of `model`: a checkpoint directory or a `.gguf` file.

    `model` is a local directory or `.gguf` file, a Hub ID (`org/name`), or `org/name/F.gguf`;
    None is the bundled SmolLM2. `gguf_file` picks one `.gguf` file of a directory or repo.
    `revision` (a branch, tag or commit) and `download_dir` (instead of the HF cache) apply
    to Hub IDs. `weights=False` fetches all but the weights (`load_format="dummy"`).
    """
    if model is None:
        if gguf_file is not None:
            raise ModelNotFoundError("gguf_file needs a model (a directory or Hub ID holding it)")
        from atom_models.bundled import smollm2_gguf_path

        return str(smollm2_gguf_path())
    path = Path(model).expanduser()
    if path.exists():
        if gguf_file is None:
            return str(path)
        if not (path / gguf_file).is_file():
            raise ModelNotFoundError(f"{gguf_file!r} not found in {path}")
        return str(path / gguf_file)
    repo_id, gguf_file = _repo_and_file(model, gguf_file)
    return _download(repo_id, revision, download_dir, gguf_file, weights, what="model")


def resolve_tokenizer(
    tokenizer: str, *, revision: str | None = None, download_dir: str | None = None
) -> str:
    """The local path of a tokenizer: a directory or `.gguf` file, or a Hub ID whose
    tokenizer files (not its weights) are fetched."""
    if Path(tokenizer).expanduser().exists():
        return str(Path(tokenizer).expanduser())
    repo_id, gguf_file = _repo_and_file(tokenizer, None, what="tokenizer")
    return _download(repo_id, revision, download_dir, gguf_file, False, what="tokenizer")


def _repo_and_file(name: str, gguf_file: str | None, what: str = "model") -> tuple[str, str | None]:
    """(repo ID, .gguf file or None) of a name that is no local path."""
    parts = name.split("/")
    if len(parts) == 3 and parts[2].endswith(".gguf"):  # org/name/F.gguf, as vLLM takes it
        if gguf_file is not None and gguf_file != parts[2]:
            raise ModelNotFoundError(f"{what} {name!r} names a .gguf file, and so does gguf_file")
        return "/".join(parts[:2]), parts[2]
    looks_local = name.startswith(("/", ".", "~")) or name.endswith(".gguf") or len(parts) > 2
    not_local = (
        f"{what} {name!r} not found: no such local path, and not a Hugging Face Hub ID "
        "(org/name, or org/name/FILE.gguf)"
    )
    if looks_local:
        raise ModelNotFoundError(not_local)
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ModelNotFoundError(not_local) from None
    return name, gguf_file


def _download(
    repo_id: str,
    revision: str | None,
    download_dir: str | None,
    gguf_file: str | None,
    weights: bool,
    what: str,
) -> str:
    """Fetch what ATOM loads of `repo_id` (or take it from the cache); the local path. Every
    failure becomes one `ModelNotFoundError` naming its cause and its remedy."""
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision!r}" if revision else ""
    cache = download_dir or constants.HF_HUB_CACHE
    try:
        if gguf_file is not None:
            path = hf_hub_download(repo_id, gguf_file, revision=revision, cache_dir=download_dir)
            logger.info("%s %s%s: %s", what, repo_id, at, path)
            return path
        snapshot = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=download_dir,
            allow_patterns=NON_WEIGHT_PATTERNS,
            ignore_patterns=TOP_LEVEL_ONLY,
        )
        index = Path(snapshot) / INDEX
        if weights:
            # The index's shards only (a repo may also hold e.g. a consolidated copy), at the
            # commit just resolved: with its file list cached, no second look-up.
            names = (
                sorted(set(json.loads(index.read_text())["weight_map"].values()))
                if index.is_file()
                else ["*.safetensors"]
            )
            snapshot_download(
                repo_id,
                revision=Path(snapshot).name,
                cache_dir=download_dir,
                allow_patterns=names,
                ignore_patterns=TOP_LEVEL_ONLY,
            )
        logger.info("%s %s%s: %s", what, repo_id, at, snapshot)
        return snapshot
    except GatedRepoError:  # before RepositoryNotFoundError: it is one
        raise ModelNotFoundError(
            f"{what} {repo_id!r} is gated on the Hugging Face Hub: accept its terms on "
            f"{constants.ENDPOINT}/{repo_id} and set HF_TOKEN to an access token of that account "
            "(or run `hf auth login`)"
        ) from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"{what} {repo_id!r} not found: no such local path, and the Hugging Face Hub "
            f"({constants.ENDPOINT}) has no such model; check the name (a private model needs "
            "HF_TOKEN set to a token that may read it)"
        ) from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(
            f"revision {revision!r} of {what} {repo_id!r} not found on the Hugging Face Hub: "
            "pass one of its branches, tags or commits to --revision"
        ) from None
    except RemoteEntryNotFoundError:
        raise ModelNotFoundError(
            f"{what} {repo_id!r}{at} has no file {gguf_file!r} on the Hugging Face Hub: check "
            "the file name (the repo's files are listed on its page)"
        ) from None
    except LocalEntryNotFoundError as e:  # not cached (or partly), and the Hub unreachable
        if constants.is_offline_mode():
            raise ModelNotFoundError(
                f"{what} {repo_id!r}{at} is not (fully) in the Hugging Face cache {cache} and "
                "HF_HUB_OFFLINE is set: download it once with network access, or point HF_HOME "
                "/ HF_HUB_CACHE / --download-dir at a cache that holds it"
            ) from None
        raise ModelNotFoundError(
            f"{what} {repo_id!r}{at} is not (fully) in the Hugging Face cache {cache}, and the "
            f"Hub ({constants.ENDPOINT}) could not be reached: check the network or proxy "
            f"(HF_ENDPOINT for a mirror) [{type(e.__cause__ or e).__name__}]"
        ) from None
    except HfHubHTTPError as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelNotFoundError(
            f"downloading {what} {repo_id!r}{at} from {constants.ENDPOINT} failed: {first_line}"
        ) from None
    except OSError as e:  # the cache's disk: full, read-only, no permission
        raise ModelNotFoundError(
            f"could not store {what} {repo_id!r}{at} in the Hugging Face cache {cache}: {e} "
            "(free space, or point --download-dir / HF_HUB_CACHE elsewhere)"
        ) from None
