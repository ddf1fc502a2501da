// liblayerzero_trt_register.so: registers the LayerZero plugin creators with TensorRT's global plugin registry
// as soon as it is loaded (REGISTER_TENSORRT_PLUGIN style). For loaders that only dlopen a library:
//   LD_PRELOAD=liblayerzero_trt_register.so tritonserver ...
//   tritonserver --backend-config=tensorrt,plugins="/path/liblayerzero_trt_register.so"
//   trtexec --staticPlugins=/path/liblayerzero_trt_register.so ...
// It depends on liblayerzero_trt.so (same directory, via RPATH $ORIGIN), which holds the plugin itself.
#include "moe_plugin.h"

#include <string>

extern "C" nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);

namespace {

struct StaticRegistration {
    StaticRegistration() {
        int32_t count = 0;
        nvinfer1::IPluginCreatorInterface* const* creators = getCreators(count);
        nvinfer1::IPluginRegistry* registry = getPluginRegistry();
        if (registry == nullptr) {
            layerzero::logMessage(nvinfer1::ILogger::Severity::kERROR, "no TensorRT plugin registry to register with");
            return;
        }
        for (int32_t i = 0; i < count; ++i) {
            if (!registry->registerCreator(*creators[i], layerzero::kPluginNamespace)) {
                layerzero::logMessage(nvinfer1::ILogger::Severity::kERROR,
                                      std::string("could not register the plugin creator in namespace ") +
                                          layerzero::kPluginNamespace + " (already registered?)");
            }
        }
    }
};

StaticRegistration gStaticRegistration;

}  // namespace
