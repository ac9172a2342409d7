"""Facts about torch/CUDA/NVML on a real GPU, printed as JSON, for gpulab's GPU fixes."""
import json, os, sys, time, warnings, traceback
import torch
from torch import nn
from torch.profiler import profile, ProfilerActivity, record_function

out = {}
def guard(name):
    def deco(fn):
        try:
            out[name] = fn()
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()[-1500:]}
        return fn
    return deco

@guard("versions")
def _():
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version,
            "device": torch.cuda.get_device_name(0), "cap": torch.cuda.get_device_capability(0),
            "uuid": str(torch.cuda.get_device_properties(0).uuid)}

@guard("kineto")
def _():
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(256, 1024, device="cuda"); y = torch.randint(0, 10, (256,), device="cuda")
    hx = torch.randn(256, 1024).pin_memory()
    for _ in range(3):
        nn.functional.cross_entropy(model(x), y).backward(); opt.step()
    torch.cuda.synchronize()
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    prof.start()
    t_loop0 = time.perf_counter_ns()
    for _ in range(3):
        with record_function("train_step"):
            xb = hx.to("cuda")
            loss = nn.functional.cross_entropy(model(xb), y)
            opt.zero_grad(); loss.backward(); opt.step()
            time.sleep(0.003)
    t_loop1 = time.perf_counter_ns()
    prof.stop()
    events = prof.profiler.kineto_results.events()
    e0 = events[0]
    methods = [m for m in dir(e0) if not m.startswith("_")]
    cuda = torch.autograd.DeviceType.CUDA
    rows, seen = [], set()
    syncs = []
    for e in events:
        ann = e.is_user_annotation() if hasattr(e, "is_user_annotation") else None
        key = (e.name()[:60], str(e.device_type()), ann)
        if e.name() in ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize"):
            syncs.append({"name": e.name(), "start_ns": e.start_ns(), "dur_us": (e.end_ns()-e.start_ns())/1e3})
        if key in seen: continue
        seen.add(key)
        row = {"name": e.name()[:80], "device_type": str(e.device_type()), "device_index": e.device_index(),
               "is_user_annotation": ann, "dur_us": (e.end_ns() - e.start_ns()) / 1e3}
        for m in ("activity_type", "correlation_id", "linked_correlation_id", "is_async", "flops"):
            if hasattr(e, m):
                try: row[m] = str(getattr(e, m)())
                except Exception as ex: row[m] = f"err {ex}"
        rows.append(row)
    return {"methods": methods, "n_events": len(events), "unique": rows[:400], "syncs": syncs,
            "loop_ns": [t_loop0, t_loop1], "first_event_ns": min(e.start_ns() for e in events),
            "last_event_end_ns": max(e.end_ns() for e in events)}

@guard("sync_debug_copies")
def _():
    res = {}
    torch.cuda.set_sync_debug_mode("warn")
    try:
        for label, src, nb in [("pageable_blocking", torch.randn(1024, 1024), False),
                               ("pageable_nonblocking", torch.randn(1024, 1024), True),
                               ("pinned_blocking", torch.randn(1024, 1024).pin_memory(), False),
                               ("pinned_nonblocking", torch.randn(1024, 1024).pin_memory(), True)]:
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                big = torch.randn(4096, 4096, device="cuda"); big = big @ big  # queue work first
                t0 = time.perf_counter(); d = src.to("cuda", non_blocking=nb); t1 = time.perf_counter()
                torch.cuda.synchronize(); t2 = time.perf_counter()
            res[label] = {"warnings": [str(x.message)[:120] for x in w], "call_ms": (t1-t0)*1e3, "then_sync_ms": (t2-t1)*1e3}
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return res

@guard("nvml")
def _():
    import pynvml as n
    n.nvmlInit()
    r = {"driver": n.nvmlSystemGetDriverVersion(), "nvml_version": n.nvmlSystemGetNVMLVersion(),
         "cuda_driver_version": n.nvmlSystemGetCudaDriverVersion(),
         "count": n.nvmlDeviceGetCount()}
    try: r["cuda_driver_version_v2"] = n.nvmlSystemGetCudaDriverVersion_v2()
    except Exception as e: r["cuda_driver_version_v2"] = repr(e)
    h = n.nvmlDeviceGetHandleByIndex(0)
    for f in ("nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetMigMode", "nvmlDeviceGetPciInfo",
              "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetComputeRunningProcesses"):
        try: r[f] = str(getattr(n, f)(h))[:300]
        except Exception as e: r[f] = repr(e)
    x = torch.randn(4096, 4096, device="cuda")
    t_end = time.time() + 1.0
    ts = int((time.time() - 2) * 1e6)
    while time.time() < t_end:
        x = (x @ x).tanh_()
    torch.cuda.synchronize()
    try:
        pu = n.nvmlDeviceGetProcessUtilization(h, ts)
        r["process_utilization"] = [{"pid": p.pid, "sm": p.smUtil, "mem": p.memUtil, "ts": p.timeStamp} for p in pu]
    except Exception as e: r["process_utilization"] = repr(e)
    r["my_pid"] = os.getpid()
    try:
        sup = n.nvmlGpmQueryDeviceSupport(h); r["gpm_supported"] = sup.isSupportedDevice
        def gpm(gap):
            s1 = n.nvmlGpmSampleAlloc(); s2 = n.nvmlGpmSampleAlloc()
            n.nvmlGpmSampleGet(h, s1)
            t_end = time.time() + gap
            y = torch.randn(4096, 4096, device="cuda")
            while time.time() < t_end: y = (y @ y).tanh_()
            torch.cuda.synchronize()
            n.nvmlGpmSampleGet(h, s2)
            mg = n.c_nvmlGpmMetricsGet_t(); mg.version = n.NVML_GPM_METRICS_GET_VERSION
            mg.numMetrics = 2; mg.sample1 = s1; mg.sample2 = s2
            mg.metrics[0].metricId = n.NVML_GPM_METRIC_SM_OCCUPANCY; mg.metrics[1].metricId = n.NVML_GPM_METRIC_GRAPHICS_UTIL
            n.nvmlGpmMetricsGet(mg)
            return [(mg.metrics[i].metricId, mg.metrics[i].value, mg.metrics[i].nvmlReturn) for i in range(2)]
        for gap in (0.02, 0.05, 0.11, 0.2):
            try: r[f"gpm_gap_{gap}"] = gpm(gap)
            except Exception as e: r[f"gpm_gap_{gap}"] = repr(e)
    except Exception as e: r["gpm"] = repr(e)
    n.nvmlShutdown()
    return r

print(json.dumps(out, indent=1, default=str))
