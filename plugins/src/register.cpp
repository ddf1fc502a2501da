// liblayerzero_trt_register.so: registers the LayerZero plugin creators with TensorRT's global plugin registry
// as soon as it is loaded (REGISTER_TENSORRT_PLUGIN style). For loaders that only dlopen a library:
//   LD_PRELOAD=liblayerzero_trt_register.so tritonserver ...
//   tritonserver --backend-config=tensorrt,plugins="/path/liblayerzero_trt_register.so"
//   trtexec --staticPlugins=/path/liblayerzero_trt_register.so ...
// It depends on liblayerzero_trt.so (same directory, via RPATH $ORIGIN), which holds the plugin itself.
//
// NOTE: this library may call only extern "C" entry points of other libraries: getCreators of
// liblayerzero_trt.so, getPluginRegistry / getLogger of libnvinfer. liblayerzero_trt.so is built with hidden
// visibility, so a C++ function of it (layerzero::logMessage) links here only to fail at dlopen; the link uses
// --no-undefined to catch that.
#include <NvInferRuntime.h>

#include <cstdio>
#include <string>

extern "C" nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);

namespace {

constexpr char const* kNamespace = "layerzero";

// TensorRT's global logger (the one its standalone functions use), else stderr.
void logError(std::string const& message) noexcept {
    std::string const text = "liblayerzero_trt_register.so: " + message;
    nvinfer1::ILogger* logger = getLogger();
    if (logger != nullptr) {
        logger->log(nvinfer1::ILogger::Severity::kERROR, text.c_str());
    } else {
        std::fprintf(stderr, "[layerzero] %s\n", text.c_str());
    }
}

struct StaticRegistration {
    StaticRegistration() {
        int32_t count = 0;
        nvinfer1::IPluginCreatorInterface* const* creators = getCreators(count);
        nvinfer1::IPluginRegistry* registry = getPluginRegistry();
        if (registry == nullptr) {
            logError("no TensorRT plugin registry to register with");
            return;
        }
        for (int32_t i = 0; i < count; ++i) {
            if (!registry->registerCreator(*creators[i], kNamespace)) {
                logError(std::string("could not register the plugin creator in namespace ") + kNamespace +
                         " (already registered? load liblayerzero_trt.so or this library, not both)");
            }
        }
    }
};

StaticRegistration gStaticRegistration;

}  // namespace
