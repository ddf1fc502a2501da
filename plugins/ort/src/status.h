// The kernels' one-line errors as ONNX Runtime statuses (liblayerzero_ort.so).
#pragma once

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <exception>
#include <string>

namespace lz {

// What a kernel refuses: the status code and the one line naming the node.
struct Failure {
  OrtErrorCode code;
  std::string message;
};

// fn() as an ORT status: nullptr, a Failure's code and line, or another exception's text under `other`.
template <class Fn>
OrtStatusPtr guarded(OrtErrorCode other, Fn&& fn) {
  try {
    fn();
    return nullptr;
  } catch (const Failure& f) {
    return Ort::GetApi().CreateStatus(f.code, f.message.c_str());
  } catch (const std::exception& e) {
    return Ort::GetApi().CreateStatus(other, e.what());
  }
}

}  // namespace lz
