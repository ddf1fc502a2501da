// Work items on ONNX Runtime's intra-op thread pool, for the kernels of liblayerzero_ort.so.
#pragma once

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <cstddef>
#include <functional>

namespace lz {

// work(0) .. work(items - 1) through the kernel context's pool (on the calling thread alone when items is 1).
inline void parallel_items(Ort::KernelContext& ctx, size_t items, const std::function<void(size_t)>& work) {
  if (items == 1) {
    work(0);
    return;
  }
  ctx.ParallelFor([](void* data, size_t i) { (*static_cast<const std::function<void(size_t)>*>(data))(i); }, items,
                  0, const_cast<void*>(static_cast<const void*>(&work)));
}

}  // namespace lz
