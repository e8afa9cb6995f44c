// XLA FFI GPU target of jax-dqpost: launches a CuTe DSL-compiled postprocess kernel on XLA's stream.
//
// The kernel arrives as an attribute of the custom call: an object module produced by
// `cute.compile(...).dump_to_object(kFunctionPrefix)` at lowering time, so compiled executables and
// `jax.export` artifacts carry their own binary. Modules are loaded once per process through the CuTe
// runtime C API (libcute_dsl_runtime.so, shipped by nvidia-cutlass-dsl and opened with dlopen at a path
// given by Python). Each custom call instance resolves its function once, in the instantiate stage (outside
// any CUDA graph capture), into its own FFI state; execute takes it from there (no lock, no lookup) and
// enqueues one launch. Nothing here blocks on the stream.
//
// One target is emitted (Execute); two earlier ones stay registered so that artifacts exported by earlier versions
// keep running (ExecuteV1, ExecuteV2: their modules travel inside the artifacts).
//
// Each execute handler is exported twice: plain, and marked command-buffer compatible (suffix `Capturable`),
// which lets XLA record the launch into its command buffers by stream capture. jax_dqpost/_ffi.py registers the
// plain one unless asked (JAX_DQPOST_COMMAND_BUFFERS=1): a launch captured while a jax.profiler session is active
// fails when the graph is replayed after the session (docs/design.md, "CUDA graphs and the profiler").
//
// Needs only a C++17 compiler and the XLA FFI headers: no CUDA toolkit at build time.

#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// An opaque CUDA stream: XLA hands us its cudaStream_t, we hand it on to the CuTe runtime.
struct CUstream_st;
using CudaStream = CUstream_st*;

namespace {

// The symbol prefix given to dump_to_object() in jax_dqpost/kernel_cache.py.
constexpr char kFunctionPrefix[] = "jax_dqpost";

// ------------------------------------------------------------------------------------------------
// The subset of CuteDSLRuntime.h we use, resolved with dlopen/dlsym.
struct CuteModule;
struct CuteFunction;
using CreateFn = int (*)(CuteModule**, const unsigned char*, size_t, const char**, size_t);
using GetFunctionFn = int (*)(CuteFunction**, CuteModule*, const char*);
using RunFn = int (*)(void*, void**, size_t);
using ErrorStringFn = const char* (*)(int);

struct CuteRuntime {
  CreateFn create = nullptr;
  GetFunctionFn get_function = nullptr;
  RunFn run = nullptr;
  ErrorStringFn error_string = nullptr;
};

std::mutex g_mutex;  // guards everything below
CuteRuntime g_runtime;
bool g_runtime_loaded = false;
// fingerprint (sha256 of the module bytes) -> launchable function. Modules live until process exit.
std::unordered_map<std::string, CuteFunction*> g_functions;

std::string RuntimeError(const char* what, int code) {
  std::string msg = std::string(what) + " failed with CuTe runtime error " + std::to_string(code);
  if (g_runtime.error_string != nullptr) msg += std::string(": ") + g_runtime.error_string(code);
  return msg;
}

// Loads (once) the module with this fingerprint and returns its function.
ffi::ErrorOr<CuteFunction*> GetFunction(std::string_view module, std::string_view fingerprint) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_runtime_loaded) {
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                                      "jax_dqpost: the CuTe DSL runtime library is not loaded "
                                      "(jax_dqpost._ffi.register() sets it up)"));
  }
  std::string key(fingerprint);
  auto it = g_functions.find(key);
  if (it != g_functions.end()) return it->second;
  if (module.empty()) return ffi::Unexpected(ffi::Error::InvalidArgument("jax_dqpost: empty kernel module"));
  CuteModule* mod = nullptr;
  int err = g_runtime.create(&mod, reinterpret_cast<const unsigned char*>(module.data()), module.size(),
                             nullptr, 0);
  if (err != 0) return ffi::Unexpected(ffi::Error::Internal(RuntimeError("CuteDSLRT_Module_Create_From_Bytes", err)));
  CuteFunction* fn = nullptr;
  err = g_runtime.get_function(&fn, mod, kFunctionPrefix);
  if (err != 0) return ffi::Unexpected(ffi::Error::Internal(RuntimeError("CuteDSLRT_Module_Get_Function", err)));
  g_functions.emplace(std::move(key), fn);
  return fn;
}

bool FitsInt32(int64_t v) { return v >= 0 && v <= std::numeric_limits<int32_t>::max(); }

// The varlen work list's layout (jax_dqpost/varlen.py; tests/test_cuda_lowering.py pins these to it):
// tile_start[spans + 1] | spans[spans][kSpanFields] | tile_span[num_tiles], spans = batch + 2.
constexpr int64_t kSpanFields = 4;
int64_t WorkListSize(int64_t batch, int64_t num_tiles) { return (kSpanFields + 1) * (batch + 2) + 1 + num_tiles; }
// Accumulator rows FlashAttention allocates for a packed batch: round_up(total + batch * tile_m, tile_m).
int64_t PaddedTotal(int64_t total, int64_t batch, int64_t tile_m) {
  return (total + (batch + 1) * tile_m - 1) / tile_m * tile_m;
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// ------------------------------------------------------------------------------------------------
// The per-instance state: the loaded function of the instance's module (owned by the process-wide cache).
struct LoadedKernel {
  static ffi::TypeId id;
  CuteFunction* fn = nullptr;
};
ffi::TypeId LoadedKernel::id = {};
const XLA_FFI_TypeInfo kLoadedKernelTypeInfo = ffi::MakeTypeInfo<LoadedKernel>();

// Instantiate stage: load the module (once per process) and keep its function in this instance's state.
ffi::ErrorOr<std::unique_ptr<LoadedKernel>> Instantiate(ffi::Dictionary attrs) {
  auto module = attrs.get<std::string_view>("module");
  auto fingerprint = attrs.get<std::string_view>("fingerprint");
  if (module.has_error()) return ffi::Unexpected(module.error());
  if (fingerprint.has_error()) return ffi::Unexpected(fingerprint.error());
  auto fn = GetFunction(*module, *fingerprint);
  if (fn.has_error()) return ffi::Unexpected(fn.error());
  auto state = std::make_unique<LoadedKernel>();
  state->fn = *fn;
  return state;
}

bool FitsExtents(ffi::Span<const int64_t> extents, int32_t* out) {
  for (size_t i = 0; i < extents.size(); ++i) {
    if (!FitsInt32(extents[i])) return false;
    out[i] = static_cast<int32_t>(extents[i]);
  }
  return true;
}

// The device address of every operand, then of every result, each checked against its expected size in bytes
// (so a buffer never disagrees with the extents the kernel indexes it by) and for 16-byte alignment.
ffi::Error CollectBuffers(ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Span<const int64_t> bytes,
                          void** out) {
  const size_t n = args.size() + rets.size();
  if (bytes.size() != n) return ffi::Error::InvalidArgument("jax_dqpost: bytes does not match the call's buffers");
  for (size_t i = 0; i < n; ++i) {
    void* data = nullptr;
    size_t size = 0;
    if (i < args.size()) {
      auto buf = args.get<ffi::AnyBuffer>(i);
      if (buf.has_error()) return buf.error();
      data = buf->untyped_data(), size = buf->size_bytes();
    } else {
      auto buf = rets.get<ffi::AnyBuffer>(i - args.size());
      if (buf.has_error()) return buf.error();
      data = (*buf)->untyped_data(), size = (*buf)->size_bytes();
    }
    if (static_cast<int64_t>(size) != bytes[i]) {
      return ffi::Error::InvalidArgument("jax_dqpost: buffer " + std::to_string(i) + " has " + std::to_string(size) +
                                         " bytes, expected " + std::to_string(bytes[i]));
    }
    if (!Aligned16(data)) return ffi::Error::InvalidArgument("jax_dqpost: buffers must be 16-byte aligned");
    out[i] = data;
  }
  return ffi::Error::Success();
}

// Runs the loaded entry point with these argument addresses (its arguments in order, then the stream and the
// int32 return code: the last two entries of call).
ffi::Error Run(LoadedKernel* kernel, void** call, size_t count) {
  const int err = g_runtime.run(kernel->fn, call, count);
  if (err != 0) return ffi::Error::Internal(RuntimeError("CuteDSLRT_Function_Run", err));
  const int32_t ret = *static_cast<int32_t*>(call[count - 1]);
  if (ret != 0) return ffi::Error::Internal("jax_dqpost: kernel launch failed with CUDA error " + std::to_string(ret));
  return ffi::Error::Success();
}

// ------------------------------------------------------------------------------------------------
// The target: the kernel of jax_dqpost/kernel.py, called as jax_dqpost/abi.py declares it: every operand, then
// every result, as a device pointer; then kExtentsPerPart int32 extents per part; then the stream. Attributes:
// "bytes", each buffer's size; "extents" (Plan.launch); "ctas", the launch's CTAs (0: nothing to do).
constexpr int64_t kExtentsPerPart = 5;  // abi.EXTENTS
constexpr int64_t kMaxParts = 3;        // abi.PARTS
constexpr size_t kMaxBuffers = 16;      // more than any call has (abi.pointers: at most 13)

ffi::Error Execute(CudaStream stream, LoadedKernel* kernel, ffi::RemainingArgs args, ffi::RemainingRets rets,
                   std::string_view /*module: the instantiate stage's*/, std::string_view /*fingerprint*/,
                   ffi::Span<const int64_t> bytes, ffi::Span<const int64_t> extents, int64_t ctas) {
  const size_t n = args.size() + rets.size();
  const size_t num_extents = extents.size();
  if (n > kMaxBuffers || num_extents == 0 || num_extents % kExtentsPerPart != 0 ||
      num_extents > static_cast<size_t>(kMaxParts * kExtentsPerPart)) {
    return ffi::Error::InvalidArgument("jax_dqpost: the call's buffers or extents do not fit the kernel");
  }
  void* ptrs[kMaxBuffers] = {};
  if (ffi::Error err = CollectBuffers(args, rets, bytes, ptrs); err.failure()) return err;
  int32_t ext[kMaxParts * kExtentsPerPart];
  if (!FitsExtents(extents, ext)) return ffi::Error::InvalidArgument("jax_dqpost: extent out of int32 range");
  if (!FitsInt32(ctas)) return ffi::Error::InvalidArgument("jax_dqpost: too many CTAs for one launch");
  if (ctas == 0) return ffi::Error::Success();  // no work
  CudaStream st = stream;
  int32_t ret = 0;
  void* call[kMaxBuffers + kMaxParts * kExtentsPerPart + 2];
  size_t k = 0;
  for (size_t i = 0; i < n; ++i) call[k++] = &ptrs[i];
  for (size_t i = 0; i < num_extents; ++i) call[k++] = &ext[i];
  call[k++] = &st;
  call[k++] = &ret;
  return Run(kernel, call, k);
}

// ------------------------------------------------------------------------------------------------
// Earlier targets, kept for artifacts exported by earlier versions (never emitted now).
//
// v1: the single-tensor kernel of jax-dqpost <= 0.1 (acc, dq, scale, aux, then five int32 extents). The launch, as
// that module's entry point takes it:
struct Launch {
  int32_t batch_or_spans = 0;  // batch, or the number of spans (varlen): the kernel's z extent or work list
  int32_t heads = 0;
  int32_t rows = 0;      // seqlen, or total_q (varlen)
  int32_t head_dim = 0;
  int32_t grid_x = 0;    // CTAs per head (the kernel launches heads * grid_x along x)
};

enum Mode : int64_t { kDense = 0, kDenseSeqused = 1, kVarlen = 2 };

// Checks the buffers against the tiling's contract (jax_dqpost/plan.py) and fills the launch.
ffi::Error CheckAndPlan(int64_t mode, const ffi::Buffer<ffi::F32>& acc, const ffi::Buffer<ffi::S32>& aux,
                        const ffi::AnyBuffer& dq, int64_t tile_m, int64_t padded_head_dim, int64_t num_tiles,
                        Launch* launch) {
  const auto a = acc.dimensions();
  const auto d = dq.dimensions();
  if (tile_m <= 0 || padded_head_dim <= 0) return ffi::Error::InvalidArgument("jax_dqpost: bad tile attributes");
  int64_t batch = 0, heads = 0, rows = 0, head_dim = 0, grid_x = 0, batch_or_spans = 0;
  if (mode == kDense || mode == kDenseSeqused) {
    if (a.size() != 3 || d.size() != 4) {
      return ffi::Error::InvalidArgument("jax_dqpost: dense dq_accum must have rank 3 and dq rank 4");
    }
    batch = d[0], rows = d[1], heads = d[2], head_dim = d[3];
    if (a[0] != batch || a[1] != heads) {
      return ffi::Error::InvalidArgument("jax_dqpost: dq_accum and dq disagree on batch or heads");
    }
    grid_x = (rows + tile_m - 1) / tile_m;
    if (a[2] != grid_x * tile_m * padded_head_dim) {
      return ffi::Error::InvalidArgument("jax_dqpost: dq_accum's last dim is not ceil(S/tile_m)*tile_m*tile_hdim");
    }
    const int64_t want_aux = mode == kDenseSeqused ? batch : 0;
    if (aux.element_count() != static_cast<size_t>(want_aux)) {
      return ffi::Error::InvalidArgument("jax_dqpost: seqused_q must have batch entries");
    }
    batch_or_spans = batch;
  } else if (mode == kVarlen) {
    if (a.size() != 2 || d.size() != 3) {
      return ffi::Error::InvalidArgument("jax_dqpost: varlen dq_accum must have rank 2 and dq rank 3");
    }
    rows = d[0], heads = d[1], head_dim = d[2];
    // The batch whose work list has this size (at least one sequence).
    const int64_t rest = static_cast<int64_t>(aux.element_count()) - WorkListSize(-2, num_tiles);
    batch = rest / (kSpanFields + 1) - 2;
    if (num_tiles < 0 || batch < 1 || WorkListSize(batch, num_tiles) != static_cast<int64_t>(aux.element_count())) {
      return ffi::Error::InvalidArgument("jax_dqpost: the work list does not match num_tiles");
    }
    batch_or_spans = batch + 2;  // the kernel takes the number of spans
    if (a[0] != heads || a[1] != PaddedTotal(rows, batch, tile_m) * padded_head_dim) {
      return ffi::Error::InvalidArgument("jax_dqpost: dq_accum is not (heads, Tp * tile_hdim)");
    }
    grid_x = num_tiles;
  } else {
    return ffi::Error::InvalidArgument("jax_dqpost: unknown mode");
  }
  if (head_dim % 8 != 0 || head_dim > padded_head_dim) {
    return ffi::Error::InvalidArgument("jax_dqpost: head_dim must be a multiple of 8 and <= tile_hdim");
  }
  // The launch grid is (heads * grid_x, 1, batch) (varlen: batch 1): x < 2^31, z <= 65535.
  if (!FitsInt32(batch_or_spans) || !FitsInt32(rows) || !FitsInt32(heads * head_dim) ||
      !FitsInt32(heads * grid_x) || (mode != kVarlen && batch_or_spans > 65535)) {
    return ffi::Error::InvalidArgument(
        "jax_dqpost: need batch <= 65535 and rows, heads * head_dim, heads * CTAs per head < 2^31");
  }
  *launch = Launch{static_cast<int32_t>(batch_or_spans), static_cast<int32_t>(heads), static_cast<int32_t>(rows),
                   static_cast<int32_t>(head_dim), static_cast<int32_t>(grid_x)};
  return ffi::Error::Success();
}

// Execute stage: validate the buffers against the kernel's contract, then enqueue one launch.
ffi::Error ExecuteV1(CudaStream stream, LoadedKernel* kernel,
                   ffi::Buffer<ffi::F32> acc,        // fp32 accumulator, (B, H, Sr*Dr) or varlen (H, Tp*Dr)
                   ffi::Buffer<ffi::F32> scale,      // () softmax scale, in device memory
                   ffi::Buffer<ffi::S32> aux,        // seqused_q (B,), the varlen work list, or empty
                   ffi::Result<ffi::AnyBuffer> dq,   // (B, S, H, D) or varlen (T, H, D), bf16/fp16
                   std::string_view /*module*/,      // CuTe object module (bytes): loaded by Instantiate
                   std::string_view /*fingerprint*/, // sha256 of module, the load-cache key
                   std::string_view dtype,           // "bf16" or "f16": the type compiled into module
                   int64_t mode,                     // plan.Tiling: 0 dense, 1 dense with seqused_q, 2 varlen
                   int64_t tile_m,                   // rows per accumulator tile
                   int64_t padded_head_dim,          // attribute "tile_hdim": Dr, compiled into module
                   int64_t num_tiles) {              // varlen: CTAs per head (0 otherwise)
  if (scale.element_count() != 1) return ffi::Error::InvalidArgument("jax_dqpost: scale must be a scalar");
  const ffi::DataType want = dtype == "bf16" ? ffi::DataType::BF16
                             : dtype == "f16" ? ffi::DataType::F16
                                              : ffi::DataType::INVALID;
  if (want == ffi::DataType::INVALID || dq->element_type() != want) {
    return ffi::Error::InvalidArgument("jax_dqpost: dq element type does not match the compiled kernel");
  }
  Launch launch;
  if (ffi::Error err = CheckAndPlan(mode, acc, aux, *dq, tile_m, padded_head_dim, num_tiles, &launch);
      err.failure()) {
    return err;
  }
  if (!Aligned16(acc.untyped_data()) || !Aligned16(dq->untyped_data())) {
    return ffi::Error::InvalidArgument("jax_dqpost: dq_accum and dq must be 16-byte aligned");
  }
  if (dq->element_count() == 0 || launch.grid_x == 0) return ffi::Error::Success();  // no work

  // One pointer per argument of the @cute.jit entry point, in order, then the int32 return code:
  // (acc, dq, scale, aux, batch_or_spans, heads, rows, head_dim, grid_x, stream) -> ret.
  void* acc_ptr = acc.untyped_data();
  void* dq_ptr = dq->untyped_data();
  void* scale_ptr = scale.untyped_data();
  void* aux_ptr = aux.untyped_data();
  CudaStream st = stream;
  int32_t ret = 0;
  void* args[] = {&acc_ptr, &dq_ptr, &scale_ptr, &aux_ptr, &launch.batch_or_spans, &launch.heads, &launch.rows,
                  &launch.head_dim, &launch.grid_x, &st, &ret};
  return Run(kernel, args, sizeof(args) / sizeof(args[0]));
}

// v2: the fused kernel of jax-dqpost <= 0.1: kFusedSlots pointers in a fixed order (attribute "slots" gives each
// buffer's), then kFusedExtents int32 extents.
constexpr int64_t kFusedSlots = 13;
constexpr int64_t kFusedExtents = 15;

ffi::Error ExecuteV2(CudaStream stream, LoadedKernel* kernel, ffi::RemainingArgs args, ffi::RemainingRets rets,
                     std::string_view /*module*/, std::string_view /*fingerprint*/, ffi::Span<const int64_t> slots,
                     ffi::Span<const int64_t> bytes, ffi::Span<const int64_t> extents, int64_t ctas) {
  const size_t n = args.size() + rets.size();
  if (n > static_cast<size_t>(kFusedSlots) || slots.size() != n ||
      static_cast<int64_t>(extents.size()) != kFusedExtents) {
    return ffi::Error::InvalidArgument("jax_dqpost: slots, bytes and extents do not match the call");
  }
  void* buffers[kFusedSlots] = {};
  if (ffi::Error err = CollectBuffers(args, rets, bytes, buffers); err.failure()) return err;
  void* ptrs[kFusedSlots] = {};
  for (size_t i = 0; i < n; ++i) {
    const int64_t slot = slots[i];
    if (slot < 0 || slot >= kFusedSlots || ptrs[slot] != nullptr) {
      return ffi::Error::InvalidArgument("jax_dqpost: bad or repeated slot " + std::to_string(slot));
    }
    ptrs[slot] = buffers[i];
  }
  int32_t ext[kFusedExtents];
  if (!FitsExtents(extents, ext)) return ffi::Error::InvalidArgument("jax_dqpost: extent out of int32 range");
  if (!FitsInt32(ctas)) return ffi::Error::InvalidArgument("jax_dqpost: too many CTAs for one launch");
  if (ctas == 0) return ffi::Error::Success();  // no work
  CudaStream st = stream;
  int32_t ret = 0;
  void* call[kFusedSlots + kFusedExtents + 2];
  for (int64_t i = 0; i < kFusedSlots; ++i) call[i] = &ptrs[i];
  for (int64_t i = 0; i < kFusedExtents; ++i) call[kFusedSlots + i] = &ext[i];
  call[kFusedSlots + kFusedExtents] = &st;
  call[kFusedSlots + kFusedExtents + 1] = &ret;
  return Run(kernel, call, kFusedSlots + kFusedExtents + 2);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDqpostInstantiate, Instantiate,
                              ffi::Ffi::BindInstantiate().Attrs<ffi::Dictionary>());

// The bindings, declared once each; every handler is exported plain and command-buffer compatible.
#define JAX_DQPOST_EXECUTE_BINDING                                                   \
  ffi::Ffi::Bind()                                                                   \
      .Ctx<ffi::PlatformStream<CudaStream>>()                                       \
      .Ctx<ffi::State<LoadedKernel>>()                                              \
      .RemainingArgs()                                                              \
      .RemainingRets()                                                              \
      .Attr<std::string_view>("module") /* unused here (Instantiate loads it) */    \
      .Attr<std::string_view>("fingerprint")                                        \
      .Attr<ffi::Span<const int64_t>>("bytes")                                      \
      .Attr<ffi::Span<const int64_t>>("extents")                                    \
      .Attr<int64_t>("ctas")

#define JAX_DQPOST_EXECUTE_V1_BINDING                                                \
  ffi::Ffi::Bind()                                                                   \
      .Ctx<ffi::PlatformStream<CudaStream>>()                                       \
      .Ctx<ffi::State<LoadedKernel>>()                                              \
      .Arg<ffi::Buffer<ffi::F32>>()  /* dq_accum */                                 \
      .Arg<ffi::Buffer<ffi::F32>>()  /* scale */                                    \
      .Arg<ffi::Buffer<ffi::S32>>()  /* seqused_q / work list / empty */            \
      .Ret<ffi::AnyBuffer>()         /* dq */                                       \
      .Attr<std::string_view>("module")                                             \
      .Attr<std::string_view>("fingerprint")                                        \
      .Attr<std::string_view>("dtype")                                              \
      .Attr<int64_t>("mode")                                                        \
      .Attr<int64_t>("tile_m")                                                      \
      .Attr<int64_t>("tile_hdim")                                                   \
      .Attr<int64_t>("num_tiles")

#define JAX_DQPOST_EXECUTE_V2_BINDING                                                \
  ffi::Ffi::Bind()                                                                   \
      .Ctx<ffi::PlatformStream<CudaStream>>()                                       \
      .Ctx<ffi::State<LoadedKernel>>()                                              \
      .RemainingArgs()                                                              \
      .RemainingRets()                                                              \
      .Attr<std::string_view>("module")                                             \
      .Attr<std::string_view>("fingerprint")                                        \
      .Attr<ffi::Span<const int64_t>>("slots")                                      \
      .Attr<ffi::Span<const int64_t>>("bytes")                                      \
      .Attr<ffi::Span<const int64_t>>("extents")                                    \
      .Attr<int64_t>("ctas")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDqpostExecute, Execute, JAX_DQPOST_EXECUTE_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDqpostExecuteCapturable, Execute, JAX_DQPOST_EXECUTE_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDqpostExecuteV1, ExecuteV1, JAX_DQPOST_EXECUTE_V1_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDqpostExecuteV1Capturable, ExecuteV1, JAX_DQPOST_EXECUTE_V1_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDqpostExecuteV2, ExecuteV2, JAX_DQPOST_EXECUTE_V2_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDqpostExecuteV2Capturable, ExecuteV2, JAX_DQPOST_EXECUTE_V2_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});

// The calling convention as the handler passes it, for the test that pins it to jax_dqpost/abi.py.
extern "C" int64_t jax_dqpost_extents_per_part() { return kExtentsPerPart; }
extern "C" int64_t jax_dqpost_max_parts() { return kMaxParts; }
extern "C" int64_t jax_dqpost_max_buffers() { return static_cast<int64_t>(kMaxBuffers); }

// The state's type, registered with XLA by Python (jax.ffi.register_ffi_type) before the targets.
extern "C" void* jax_dqpost_state_type_id() { return &LoadedKernel::id; }
extern "C" const void* jax_dqpost_state_type_info() { return &kLoadedKernelTypeInfo; }

// The XLA FFI API version of the headers this library was compiled against: jax_dqpost/_ffi.py compares it with
// the running jaxlib's (the same major, a minor no newer) before registering the handlers.
extern "C" void jax_dqpost_ffi_api_version(int* major, int* minor) {
  *major = XLA_FFI_API_MAJOR;
  *minor = XLA_FFI_API_MINOR;
}

// The work list's size and the padded total as the handler computes them, for the test that pins them to
// the Python side (jax_dqpost/varlen.py).
extern "C" int64_t jax_dqpost_work_list_size(int64_t batch, int64_t num_tiles) {
  return WorkListSize(batch, num_tiles);
}
extern "C" int64_t jax_dqpost_padded_total(int64_t total, int64_t batch, int64_t tile_m) {
  return PaddedTotal(total, batch, tile_m);
}

// Called once from Python (ctypes) with the path of libcute_dsl_runtime.so. Returns 0 on success,
// else writes a message into err (size errlen) and returns -1. Idempotent.
extern "C" int jax_dqpost_load_runtime(const char* path, char* err, size_t errlen) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_runtime_loaded) return 0;
  auto fail = [&](const std::string& msg) {
    if (err != nullptr && errlen > 0) {
      const size_t n = msg.size() < errlen - 1 ? msg.size() : errlen - 1;
      msg.copy(err, n);
      err[n] = '\0';
    }
    return -1;
  };
  void* handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) return fail(std::string("dlopen failed: ") + dlerror());
  CuteRuntime rt;
  rt.create = reinterpret_cast<CreateFn>(dlsym(handle, "CuteDSLRT_Module_Create_From_Bytes"));
  rt.get_function = reinterpret_cast<GetFunctionFn>(dlsym(handle, "CuteDSLRT_Module_Get_Function"));
  rt.run = reinterpret_cast<RunFn>(dlsym(handle, "CuteDSLRT_Function_Run"));
  rt.error_string = reinterpret_cast<ErrorStringFn>(dlsym(handle, "CuteDSLRT_GetErrorString"));
  if (rt.create == nullptr || rt.get_function == nullptr || rt.run == nullptr) {
    return fail(std::string("missing CuteDSLRT_* symbols in ") + path);
  }
  g_runtime = rt;
  g_runtime_loaded = true;
  return 0;
}
