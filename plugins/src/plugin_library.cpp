// Entry points TensorRT looks up when it loads liblayerzero_trt.so as a plugin library:
// IPluginRegistry::loadLibrary, `trtexec --dynamicPlugins`, Python `registry.load_library`, and a plan that
// serialised the library (IBuilderConfig::setPluginsToSerialize). This library does not register its creator
// on dlopen; liblayerzero_trt_register.so does that for LD_PRELOAD, `trtexec --staticPlugins` and Triton's
// `--backend-config=tensorrt,plugins=`. Use one of the two in a process, never both: TensorRT refuses a
// second creator with the same name, version and namespace.
#include "moe_plugin.h"

#define LZ_EXPORT extern "C" __attribute__((visibility("default")))

namespace {
layerzero::MoEPluginCreator gMoECreator;
nvinfer1::IPluginCreatorInterface* const gCreators[] = {&gMoECreator};
}  // namespace

LZ_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder) {
    nvinfer1::ILoggerFinder* expected = nullptr;
    layerzero::gLoggerFinder.compare_exchange_strong(expected, finder);
}

LZ_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
    nbCreators = static_cast<int32_t>(sizeof(gCreators) / sizeof(gCreators[0]));
    return gCreators;
}
