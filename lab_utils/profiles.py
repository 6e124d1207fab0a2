"""Targets the notebooks run on, declared in `lab_utils/profiles/*.toml`.

A profile says where the engine runs (`cpu`, `gpu`: a local vLLM server the lab
starts; `remote`: an existing server the lab only talks to), which model it
serves, and the base engine flags. Technique flags are layered on top by
:func:`engine_argv`, which also validates them against the installed vLLM's
own argument parser and against what the device can run.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .paths import cache_dir

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    kind: str                       # "local" (the lab starts vLLM) or "remote"
    device: str                     # "cpu", "cuda" or "remote"
    description: str
    model: str                      # "embedded", a hub id or a path; "" = ask the server
    served_model_name: str
    startup_timeout_s: float
    engine: Mapping[str, Any]       # base vLLM flags, snake_case
    env: Mapping[str, str]          # environment of the server process
    models: Mapping[str, str]       # other roles: draft, small, awq, ...
    api_key_env: str = ""
    base_url: str = ""              # remote only
    #: cpu only: thread binding and preloads (`lab_utils.cpu_tuning.binding_env`
    #: keywords: bind, tcmalloc, iomp; `in_process` true/false/"one-core":
    #: `cpu_tuning.wants_in_process`, `cpu_tuning.in_process_env`;
    #: `fork_engine_core`: `lab_utils.vllm_cli.fork_engine_core`; `stack_room`:
    #: `lab_utils.pystack`; `c_kernels`: `lab_utils.cpu_kernels`; `huge_pages`:
    #: `lab_utils.huge_pages`, not with tcmalloc),
    #: measured by benchmarks/thread_binding.py
    cpu_binding: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: Per-notebook parameter defaults for this target: {notebook: {name: value}}
    #: from `[parameters."<notebook>"]` tables, checked against each notebook's
    #: parameters cell where they are used (`lab_utils.notebook.check_profile_parameters`)
    #: and applied by `lab.setup` and `runall` under explicit values.
    parameters: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    @property
    def serving(self) -> str:
        """What serves this profile's runs, for the text of findings: the
        device and the served model ("cpu, smollm2-135m")."""
        model = self.served_model_name or self.model or "the server's model"
        return f"{self.device}, {model}"

    def parameters_for(self, notebook: str) -> dict[str, Any]:
        """This profile's defaults for `notebook` (e.g. "01_chunked_prefill")."""
        return dict(self.parameters.get(notebook, {}))

    @property
    def is_remote(self) -> bool:
        return self.kind == "remote"

    def server_env(self, extra: Mapping[str, str] | None = None,
                   flags: Mapping[str, Any] | None = None) -> dict[str, str]:
        """The environment a local server of this profile starts with: on the
        CPU the compile caches under the lab's cache (`compile_cache.cache_env`,
        unless this process's environment sets them: `compile_cache.users_own`),
        the `cpu_binding` variables, `LAB_CPU_ISA`'s (`cpu_tuning.isa_env`), then
        the profile's [env], then `extra` (a per-engine override such as
        VLLM_CPU_OMP_THREADS_BIND wins); with `cpu_binding.in_process` (true, or
        "one-core" where this process may use one CPU: `cpu_tuning.wants_in_process`)
        the worker runs inside the engine-core process where that binding gives
        it every core and the engine's `flags` do not ask for per-step times
        (`cpu_tuning.in_process_env`)."""
        env: dict[str, str] = {}
        if self.device == "cpu" and not self.is_remote:
            from .compile_cache import cache_env, users_own  # compiled starts reuse earlier compiles
            env.update({k: v for k, v in cache_env().items() if not users_own(k)})
        if self.cpu_binding:
            from .cpu_tuning import profile_binding_env
            env.update(profile_binding_env(self.cpu_binding))
        if self.device == "cpu" and not self.is_remote:
            from .cpu_tuning import isa_env  # LAB_CPU_ISA=avx2: run as on an AVX2-only CPU
            env.update(isa_env())
        env = {**env, **self.env, **{str(k): str(v) for k, v in (extra or {}).items()}}
        from .cpu_tuning import in_process_env, wants_in_process
        if wants_in_process(self.cpu_binding.get("in_process")):
            # after the overrides: an engine bound to a share of the cores keeps
            # vLLM's worker process, which applies that binding
            env = in_process_env(env, flags=flags)
        return env

    @property
    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None

    def model_for(self, role: str | None = None) -> str:
        """The model id/path for a role (None = the main model), resolved."""
        ref = self.model if role is None else self.models.get(role)
        if ref is None:
            raise ConfigError(f"profile {self.name!r} names no model for role {role!r}; "
                              f"add it under [models] in {PROFILES_DIR / (self.name + '.toml')}")
        if ref == "embedded":
            from .model import ensure_embedded_model
            return str(ensure_embedded_model())
        derived = _derived_model(ref)
        if derived is not None:
            return derived
        if ref.startswith(("/", "./", "../", "~")) and not Path(ref).expanduser().exists():
            raise ConfigError(f"model path {ref!r} does not exist: fix the path in the profile "
                              "(or the role's entry under [models]), or give a hub id such as "
                              "'Qwen/Qwen2.5-7B-Instruct'")
        return str(Path(ref).expanduser()) if ref.startswith("~") else ref


_TRUNCATED = re.compile(r"embedded-(\d+)L")


def model_location(ref: str) -> str:
    """Where a profile's model reference is served from, building nothing:
    the folder the embedded model or a model derived from it (`embedded-<N>L`,
    `quantized:<recipe>`) is or will be built in, else the reference itself
    (a hub id or a path). `Profile.model_for` builds those folders."""
    if ref == "embedded":
        from .model import embedded_model_dir
        return str(embedded_model_dir())
    if ref.startswith("quantized:"):
        from .quantize import QuantizeError, quantized_model_dir
        try:
            return str(quantized_model_dir(ref.split(":", 1)[1]))
        except QuantizeError as exc:
            raise ConfigError(f"{ref!r}: {exc}") from None
    match = _TRUNCATED.fullmatch(ref)
    if match:
        from .derived_models import truncated_model_dir
        return str(truncated_model_dir(int(match.group(1))))
    return ref


def _derived_model(ref: str) -> str | None:
    """A model `lab_utils` builds from the embedded one, offline, on first use:
    `quantized:<recipe>` (`lab_utils.quantize`, e.g. quantized:w8a8) or
    `embedded-<N>L` (its first N layers, `lab_utils.derived_models`)."""
    if ref.startswith("quantized:"):
        from .quantize import QuantizeError, recipe, resolve
        try:
            recipe(ref.split(":", 1)[1])
        except QuantizeError as exc:
            raise ConfigError(f"{ref!r}: {exc}") from None
        return resolve(ref)
    match = _TRUNCATED.fullmatch(ref)
    if match:
        from .derived_models import truncated_model
        try:
            return str(truncated_model(int(match.group(1))))
        except ValueError as exc:
            raise ConfigError(f"{ref!r}: {exc}") from None
    return None


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))


def load_profile(name: str = "cpu", *, base_url: str = "", **engine_overrides: Any) -> Profile:
    """Load a profile by name (or a path to a .toml file).

    `base_url` (or LAB_REMOTE_URL) is required for remote profiles.
    `engine_overrides` replace base engine flags (e.g. tensor_parallel_size=2).
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"profile must be a non-empty string, got {name!r}; "
                          f"choose one of {available_profiles()}")
    path = Path(name) if name.endswith(".toml") else PROFILES_DIR / f"{name}.toml"
    if not path.is_file():
        close = difflib.get_close_matches(name, available_profiles(), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown profile {name!r}; choose one of "
                          f"{available_profiles()} or give a path to a .toml file.{hint}")
    data = tomllib.loads(path.read_text())
    fields = {f.name for f in dataclasses.fields(Profile)}
    unknown = set(data) - fields
    if unknown:
        raise ConfigError(f"{path}: unknown keys {sorted(unknown)}; allowed: {sorted(fields)}")
    data.setdefault("engine", {})
    data.setdefault("env", {})
    data.setdefault("models", {})
    data.setdefault("cpu_binding", {})
    if data["cpu_binding"] and data.get("device") != "cpu":
        raise ConfigError(f"{path}: [cpu_binding] applies to device = 'cpu' only")
    bad = set(data["cpu_binding"]) - {"bind", "tcmalloc", "iomp", "in_process",
                                      "fork_engine_core", "stack_room", "c_kernels",
                                      "huge_pages"}
    if bad:
        raise ConfigError(f"{path}: unknown [cpu_binding] keys {sorted(bad)}; allowed: "
                          "bind ('auto', 'all' or a CPU list), tcmalloc, iomp, in_process "
                          "(true, false or \"one-core\"), fork_engine_core, stack_room, "
                          "c_kernels, huge_pages (true or false)")
    for key in ("fork_engine_core", "stack_room", "c_kernels", "huge_pages"):
        if not isinstance(data["cpu_binding"].get(key, False), bool):   # 1 == True
            raise ConfigError(f"{path}: [cpu_binding] {key} = "
                              f"{data['cpu_binding'][key]!r}; allowed: true or false")
    if data["cpu_binding"].get("huge_pages") and data["cpu_binding"].get("tcmalloc"):
        raise ConfigError(f"{path}: [cpu_binding] huge_pages needs glibc's malloc, which "
                          "tcmalloc replaces: set tcmalloc = false, or huge_pages = false")
    from .cpu_tuning import ONE_CORE
    if data["cpu_binding"].get("in_process", False) not in (True, False, ONE_CORE):
        raise ConfigError(f"{path}: [cpu_binding] in_process = "
                          f"{data['cpu_binding']['in_process']!r}; allowed: true, false or "
                          "\"one-core\" (the worker inside the engine core only where the "
                          "engine may use a single CPU)")
    data.setdefault("parameters", {})
    bad = [k for k, v in data["parameters"].items() if not isinstance(v, dict)]
    if bad:
        raise ConfigError(f"{path}: [parameters] holds one table per notebook, e.g. "
                          f"[parameters.\"01_chunked_prefill\"] with `name = value` lines; "
                          f"{bad} are not tables")
    data["engine"] = {**data["engine"], **engine_overrides}
    data["env"] = {k: str(v) for k, v in data["env"].items()}
    if data.get("kind") == "remote":
        data["base_url"] = (base_url or os.environ.get("LAB_REMOTE_URL", "")).rstrip("/")
        if not data["base_url"].startswith(("http://", "https://")):
            raise ConfigError("the remote profile needs the server's base URL: pass "
                              "base_url='http://HOST:PORT' (notebook parameter) or set "
                              "LAB_REMOTE_URL")
    elif data.get("kind") != "local":
        raise ConfigError(f"{path}: kind must be 'local' or 'remote', got {data.get('kind')!r}")
    try:
        return Profile(**data)
    except TypeError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


# --------------------------------------------------------------------------
# Flags -> command line
# --------------------------------------------------------------------------

def flag_items(profile: Profile, flags: Mapping[str, Any]) -> dict[str, Any]:
    """Profile engine flags with technique flags layered on top (None removes one)."""
    merged = {**profile.engine, **flags}
    return {k: v for k, v in merged.items() if v is not None}


def flags_to_args(items: Mapping[str, Any]) -> list[str]:
    """{'enable_prefix_caching': False, 'max_num_batched_tokens': 512} ->
    ['--no-enable-prefix-caching', '--max-num-batched-tokens', '512'].
    Dicts become JSON (e.g. speculative_config), lists repeat their values."""
    args: list[str] = []
    for key, value in items.items():
        opt = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            args.append(opt if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, Mapping):
            args += [opt, json.dumps(dict(value), separators=(",", ":"), sort_keys=True)]
        elif isinstance(value, (list, tuple)):
            args += [opt, *map(str, value)]
        else:
            args += [opt, str(value)]
    return args


def engine_argv(profile: Profile, flags: Mapping[str, Any], *, port: int,
                host: str = "127.0.0.1", model: str | None = None,
                python: str | None = None, validate: bool = True) -> list[str]:
    """The exact command line that serves `profile` with `flags` layered on.

    It runs vLLM's own `vllm serve` entry point through `lab_utils.vllm_cli`,
    which works for both the `vllm` (GPU) and the `vllm-cpu` distributions.
    """
    if profile.is_remote:
        raise ConfigError("the remote profile launches nothing; engine flags belong to "
                          "the server you started")
    items = flag_items(profile, flags)
    if validate:
        check_device_rules(profile, items)
        check_known_options(items)
    model = model or profile.model_for()
    argv = [python or sys.executable, "-m", "lab_utils.vllm_cli", "serve", model,
            "--host", host, "--port", str(port)]
    if profile.served_model_name:
        argv += ["--served-model-name", profile.served_model_name]
    return argv + flags_to_args(items)


def display_command(argv: list[str], env: Mapping[str, str] | None = None) -> str:
    """A copy-pasteable `vllm serve ...` line for an argv built by engine_argv."""
    import shlex
    rest = argv[argv.index("serve"):] if "serve" in argv else argv
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
    return (prefix + " " if prefix else "") + "vllm " + shlex.join(rest)


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------

#: (device, condition, message naming the fix). Seen on vllm-cpu 0.32.0.
def _device_rules(device: str, items: Mapping[str, Any]) -> list[str]:
    problems = []
    dtype = str(items.get("dtype", "auto"))
    quant = items.get("quantization")
    if device == "cpu":
        if quant in ("int8_per_channel_weight_only", "fp8_per_channel") and dtype != "bfloat16":
            problems.append(f"quantization={quant!r} on the CPU needs dtype='bfloat16' "
                            f"(got {dtype!r}): add dtype='bfloat16' to this arm")
        if "gpu_memory_utilization" in items:
            problems.append("gpu_memory_utilization does not size the KV cache on the CPU: "
                            "set VLLM_CPU_KVCACHE_SPACE (GiB) in the profile's [env] instead")
        if int(items.get("tensor_parallel_size", 1)) > 1:
            problems.append("tensor_parallel_size > 1 needs several NUMA nodes on the CPU "
                            "backend; use tensor_parallel_size=1 or the gpu profile")
        kv = str(items.get("kv_cache_dtype", "auto"))
        if kv.startswith(("nvfp4", "turboquant", "ultraquant", "fp8_ds_mla", "fp8_inc")):
            problems.append(f"kv_cache_dtype={kv!r} is a GPU-only format; on the CPU use "
                            "'auto' or 'fp8'")
    spec = items.get("speculative_config")
    if spec is not None:
        if not isinstance(spec, Mapping) or not ({"method", "model"} & set(spec)):
            problems.append("speculative_config must be a dict with 'method' (e.g. 'ngram') "
                            "or 'model' (a draft model), e.g. {'method': 'ngram', "
                            "'num_speculative_tokens': 4, 'prompt_lookup_max': 4}")
    return problems


def flag_problems(profile: Profile, items: Mapping[str, Any]) -> list[str]:
    """Everything `engine_argv` would refuse in these flags (the device rules,
    then options or choices the installed vLLM does not know), one message
    per problem, each naming its fix."""
    problems = _device_rules(profile.device, items)
    try:
        check_known_options(items)
    except ConfigError as exc:
        problems += [line.removeprefix("- ") for line in str(exc).splitlines()[1:]]
    return problems


def check_device_rules(profile: Profile, items: Mapping[str, Any]) -> None:
    problems = _device_rules(profile.device, items)
    if problems:
        raise ConfigError(f"profile {profile.name!r} cannot run these flags:\n- "
                          + "\n- ".join(problems))


def vllm_version() -> str:
    """Version of the installed vLLM distribution (`vllm` or `vllm-cpu`)."""
    from importlib import metadata
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    raise ConfigError("vLLM is not installed in this environment: run `make setup` "
                      "(CPU) or install requirements-gpu.txt (GPU)")


_OPTIONS_SCRIPT = r"""
import json, sys
sys.argv = ["vllm"]
from vllm.utils.argparse_utils import FlexibleArgumentParser
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:  # older vLLM releases
    from vllm.entrypoints.openai.cli_args import make_arg_parser
p = make_arg_parser(FlexibleArgumentParser())
out = {}
for a in p._actions:
    for o in a.option_strings:
        if o.startswith("--"):
            out[o[2:]] = {"choices": [str(c) for c in a.choices] if a.choices else None,
                          "boolean": type(a).__name__ in ("BooleanOptionalAction", "_StoreTrueAction")}
print(json.dumps(out))
"""


def known_options() -> dict[str, dict]:
    """`vllm serve` options of the installed vLLM, from its own parser (cached per version)."""
    path = cache_dir() / f"vllm-serve-options-{vllm_version()}.json"
    if path.is_file():
        return json.loads(path.read_text())
    proc = subprocess.run([sys.executable, "-c", _OPTIONS_SCRIPT], capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0:
        raise ConfigError("could not read vLLM's serve options:\n" + proc.stderr[-2000:])
    options = json.loads(proc.stdout.strip().splitlines()[-1])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(options))
    return options


def check_known_options(items: Mapping[str, Any], options: Mapping[str, dict] | None = None) -> None:
    """Fail before launch on a flag or a choice the installed vLLM does not know."""
    options = options if options is not None else known_options()
    problems = []
    for key, value in items.items():
        name = key.replace("_", "-")
        spec = options.get(name)
        if spec is None:
            close = difflib.get_close_matches(
                name, [o for o in options if not o.startswith("no-")], n=3)
            hint = f"; did you mean {', '.join(c.replace('-', '_') for c in close)}?" if close else ""
            problems.append(f"unknown vLLM option {key!r}{hint}")
        elif value is False and not spec["boolean"]:
            problems.append(f"{key}=False: vLLM's --{name} takes no value; leave {key} out")
        elif value is False and "no-" + name not in options and not name.startswith("no-"):
            problems.append(f"{key}=False cannot be passed (vLLM has no --no-{name}); "
                            f"leave {key} out to keep its default")
        elif spec["choices"] and not isinstance(value, bool) and str(value) not in spec["choices"]:
            problems.append(f"{key}={value!r} is not one of {spec['choices']}")
    if problems:
        raise ConfigError("invalid engine flags for vLLM " + vllm_version() + ":\n- "
                          + "\n- ".join(problems))
