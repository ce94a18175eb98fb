"""cuda_library: CUDA C++ (.cu) sources compiled by the system nvcc, wrapped as a cc_library.

    load("//kernels/cuda:cuda.bzl", "cuda_library")

    cuda_library(
        name = "rmsnorm",
        srcs = ["rmsnorm.cu"],
        hdrs = ["rmsnorm.h"],
        deps = [":cuda_check", "//common:mt"],
    )

Each .cu becomes one relocatable object (`nvcc -c`, whole-program: no -rdc) holding sm_90a SASS
for H100/H200 plus compute_90a PTX. The objects are the srcs of a cc_library that links cudart
(//third_party:cuda), so C code and tests depend on `name` like on any other library.

nvcc runs from a small rule rather than a genrule because a genrule cannot see the headers of
its cc deps (common/mt.h, cuda_check.h, ...): the rule passes their header files as action
inputs (sandboxing works, editing a header recompiles the .cu) and their include paths to nvcc.
"""

load("@rules_cc//cc:defs.bzl", "cc_library")

NVCC = "/usr/local/cuda/bin/nvcc"

# sm_90a SASS (Hopper, with the wgmma/setmaxnreg extensions) + compute_90a PTX for the JIT.
CUDA_ARCH_FLAGS = [
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_90a,code=compute_90a",
]

NVCC_FLAGS = [
    "-std=c++17",
    "-O3",
    "-lineinfo",
    "-Xcompiler",
    "-fPIC",
    "-Xcompiler",
    "-Wall",
]

def _nvcc_objects_impl(ctx):
    comps = [d[CcInfo].compilation_context for d in ctx.attr.deps]
    headers = depset(ctx.files.hdrs, transitive = [c.headers for c in comps])

    inc = ["-I.", "-I" + ctx.bin_dir.path]
    for c in comps:
        inc += ["-I" + p for p in c.quote_includes.to_list()]
        inc += ["-I" + p for p in c.includes.to_list()]
        for p in c.system_includes.to_list():
            inc += ["-isystem", p]
        inc += ["-D" + d for d in c.defines.to_list()]

    objs = []
    for src in ctx.files.srcs:
        stem = src.basename[:-len(src.extension) - 1]
        obj = ctx.actions.declare_file("_nvcc/%s/%s.o" % (ctx.label.name, stem))
        args = ctx.actions.args()
        args.add_all(CUDA_ARCH_FLAGS + NVCC_FLAGS + ctx.attr.copts + inc)
        args.add_all(["-c", src.path, "-o", obj.path])
        ctx.actions.run(
            executable = NVCC,
            arguments = [args],
            inputs = depset([src], transitive = [headers]),
            outputs = [obj],
            mnemonic = "Nvcc",
            progress_message = "nvcc %s" % src.short_path,
            use_default_shell_env = True,  # PATH, for nvcc to find the host gcc
        )
        objs.append(obj)
    return [DefaultInfo(files = depset(objs))]

_nvcc_objects = rule(
    implementation = _nvcc_objects_impl,
    attrs = {
        "srcs": attr.label_list(allow_files = [".cu"], mandatory = True),
        "hdrs": attr.label_list(allow_files = [".h", ".cuh"]),
        "deps": attr.label_list(providers = [CcInfo]),
        "copts": attr.string_list(),
    },
)

def cuda_library(name, srcs, hdrs = [], deps = [], copts = [], **kwargs):
    """A cc_library named `name` whose objects come from nvcc.

    Args:
      name: target name.
      srcs: .cu files; each is compiled separately.
      hdrs: public headers (C-compatible; include <cuda_runtime_api.h>, not <cuda_runtime.h>).
      deps: cc_library deps; their headers and include paths reach nvcc, and they are linked.
      copts: extra nvcc flags (e.g. "--use_fast_math", "-Xptxas=-v").
      **kwargs: passed to the cc_library (visibility, testonly, tags, ...).
    """
    all_deps = deps + [Label("//third_party:cuda")]
    _nvcc_objects(
        name = name + "_nvcc",
        srcs = srcs,
        hdrs = hdrs,
        deps = all_deps,
        copts = copts,
        visibility = ["//visibility:private"],
        testonly = kwargs.get("testonly", False),
        tags = kwargs.get("tags", []),
    )
    cc_library(
        name = name,
        srcs = [":" + name + "_nvcc"],
        hdrs = hdrs,
        deps = all_deps,
        **kwargs
    )
