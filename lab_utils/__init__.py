"""vLLM Latency Lab: start real vLLM engines, drive workloads, time them the way
`vllm bench serve` does, confirm mechanisms with vLLM's counters, record findings.

    import lab_utils as lab
    ctx = lab.setup("00_baseline", globals())
    engine = ctx.engine(enable_prefix_caching=True)
    run = lab.measure(engine, lab.chat_specs(8), lab.Load.concurrent(2),
                      label="cached", results=ctx.results)
"""
from .client import Client, Load, RequestRecord, RequestSpec, Run
from .counters import delta as counter_delta
from .counters import scrape as scrape_counters
from .machine import machine_info
from .metrics import SLO, change_pct, percentile_stats, records_frame, summarize, tpot
from .monitor import LatencyMonitor
from .notebook import NotebookContext, explore, setup
from .profiles import ConfigError, Profile, load_profile
from .results import Results, measure
from .server import ArmUnavailable, Engine, EnginePool, ServerError, VLLMServer
from .workloads import (
    chat,
    chat_questions,
    chat_specs,
    code_edit_specs,
    document_specs,
    long_documents,
    quality_questions,
    synthetic_specs,
    system_prompts,
    tokenizer_for,
    warmup_prefixes,
)

__all__ = [
    "SLO",
    "ArmUnavailable",
    "Client",
    "ConfigError",
    "Engine",
    "EnginePool",
    "LatencyMonitor",
    "Load",
    "NotebookContext",
    "Profile",
    "RequestRecord",
    "RequestSpec",
    "Results",
    "Run",
    "ServerError",
    "VLLMServer",
    "change_pct",
    "chat",
    "chat_questions",
    "chat_specs",
    "code_edit_specs",
    "counter_delta",
    "document_specs",
    "explore",
    "load_profile",
    "long_documents",
    "machine_info",
    "measure",
    "percentile_stats",
    "capabilities",
    "plots",
    "quality_questions",
    "records_frame",
    "scrape_counters",
    "setup",
    "summarize",
    "synthetic_specs",
    "system_prompts",
    "tokenizer_for",
    "tpot",
    "warmup_prefixes",
]


def __getattr__(name: str):
    # Plotting pulls in matplotlib/seaborn, the probe pandas: load them when asked for.
    if name in ("plots", "capabilities"):
        import importlib
        return importlib.import_module("." + name, __name__)
    raise AttributeError(name)
