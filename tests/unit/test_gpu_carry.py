"""benchmarks/gpu_carry.py: NIXL slimmed to its UCX plugin and the libraries that loads (ELF closure)."""

from pathlib import Path

from benchmarks import gpu_carry


def _touch(p: Path) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"")
    return p


def test_slim_nixl_keeps_the_ucx_plugins_closure_and_drops_the_rest(tmp_path, monkeypatch):
    site = tmp_path
    libs, core = site / gpu_carry.NIXL_LIBS, site / gpu_carry.NIXL_CORE
    deps = {  # file name -> NEEDED entries
        "_bindings.cpython-312-x86_64-linux-gnu.so": ["libnixl.so", "libc.so.6"],
        "libnixl.so": ["libgrpc-1.so", "libstdc++.so.6"],
        "libgrpc-1.so": ["libabsl-2.so"],
        "libplugin_UCX.so": ["libucp-3.so"],
        "libucp-3.so": ["libucs-4.so"],
        "libplugin_OBJ.so": ["libaws-5.so"],
        "libuct_ib.so.0.0.0": ["libibverbs-6.so"],
    }
    _touch(site / "nixl_cu13" / "_bindings.cpython-312-x86_64-linux-gnu.so")
    _touch(core / "libnixl.so")
    _touch(core / "libobj_utils.so")
    for name in ("libplugin_UCX.so", "libplugin_OBJ.so"):
        _touch(core / "plugins" / name)
        _touch(libs / "nixl" / name)
    _touch(libs / "ucx" / "libuct_ib.so.0.0.0")
    _touch(libs / "ucx" / "libucx_perftest_cuda.so.0.0.0")
    for name in ("libgrpc-1.so", "libabsl-2.so", "libucp-3.so", "libucs-4.so", "libaws-5.so", "libibverbs-6.so",
                 "libunused-7.so"):
        _touch(libs / name)
    monkeypatch.setattr(gpu_carry, "needed", lambda so: deps.get(so.name, []))

    dropped = gpu_carry.slim_nixl(site)

    assert dropped == ["libaws-5.so", "libunused-7.so"]
    assert sorted(p.name for p in libs.glob("*.so")) == ["libabsl-2.so", "libgrpc-1.so", "libibverbs-6.so",
                                                        "libucp-3.so", "libucs-4.so"]
    assert [p.name for p in (core / "plugins").iterdir()] == ["libplugin_UCX.so"]
    assert [p.name for p in (libs / "nixl").iterdir()] == ["libplugin_UCX.so"]
    assert not (core / "libobj_utils.so").exists() and not (libs / "ucx" / "libucx_perftest_cuda.so.0.0.0").exists()
