// NOT TensorRT: a link-only stand-in for libnvinfer.so (tests only), for machines without TensorRT.
//
// liblayerzero_trt.so and liblayerzero_trt_register.so link against libnvinfer; this stub lets them be linked
// (with --no-undefined) and loaded (ctypes, the lifecycle harness) so that an unresolved symbol fails the tests.
// It implements the minimum they and the harness use: getPluginRegistry (a registry that keeps the creators it
// is given and refuses a duplicate name/version/namespace, as TensorRT does), getLogger (records messages), the
// version queries. Test hooks (extern "C" lz_stub_*) report what happened. Built by tests/plugins/test_native.py:
//   g++ -shared -fPIC -std=c++17 -isystem <TensorRT headers> nvinfer_stub.cpp -Wl,-soname,libnvinfer.so.10
#include <NvInferRuntime.h>

// The registry must implement the deprecated V2-creator overloads too (they are pure virtual).
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#define LZ_STUB_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

std::mutex gMutex;
std::string gLastMessage;
int32_t gErrors = 0;

class StubLogger final : public nvinfer1::ILogger {
public:
    void log(Severity severity, nvinfer1::AsciiChar const* msg) noexcept override {
        std::lock_guard<std::mutex> lock(gMutex);
        gLastMessage = msg != nullptr ? msg : "";
        if (severity <= Severity::kERROR) ++gErrors;
        std::fprintf(stderr, "[nvinfer stub] %s\n", gLastMessage.c_str());
    }
};

struct Entry {
    nvinfer1::IPluginCreatorInterface* creator;
    std::string key;  // name/version/namespace
};

std::string keyOf(nvinfer1::IPluginCreatorInterface& creator, char const* ns) {
    // V3One creators are the only kind LayerZero registers; read the name and version through that interface.
    if (std::strcmp(creator.getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") == 0) {
        auto& v3 = static_cast<nvinfer1::IPluginCreatorV3One&>(creator);
        return std::string(v3.getPluginName()) + "/" + v3.getPluginVersion() + "/" + (ns != nullptr ? ns : "");
    }
    return std::string("?/?/") + (ns != nullptr ? ns : "");
}

class StubRegistry final : public nvinfer1::IPluginRegistry {
public:
    bool registerCreator(nvinfer1::IPluginCreator&, nvinfer1::AsciiChar const* const) noexcept override {
        return false;  // the legacy V2 creator API: LayerZero never uses it
    }
    nvinfer1::IPluginCreator* const* getPluginCreatorList(int32_t* const n) const noexcept override {
        if (n != nullptr) *n = 0;
        return nullptr;
    }
    nvinfer1::IPluginCreator* getPluginCreator(nvinfer1::AsciiChar const* const, nvinfer1::AsciiChar const* const,
                                               nvinfer1::AsciiChar const* const) noexcept override {
        return nullptr;
    }
    void setErrorRecorder(nvinfer1::IErrorRecorder* const) noexcept override {}
    nvinfer1::IErrorRecorder* getErrorRecorder() const noexcept override { return nullptr; }
    bool deregisterCreator(nvinfer1::IPluginCreator const&) noexcept override { return false; }
    bool isParentSearchEnabled() const override { return false; }
    void setParentSearchEnabled(bool const) override {}
    nvinfer1::IPluginRegistry::PluginLibraryHandle loadLibrary(nvinfer1::AsciiChar const*) noexcept override { return nullptr; }
    void deregisterLibrary(nvinfer1::IPluginRegistry::PluginLibraryHandle) noexcept override {}
    bool registerCreator(nvinfer1::IPluginCreatorInterface& creator,
                         nvinfer1::AsciiChar const* const ns) noexcept override {
        std::lock_guard<std::mutex> lock(gMutex);
        std::string const key = keyOf(creator, ns);
        for (Entry const& e : mEntries) {
            if (e.key == key) return false;
        }
        mEntries.push_back({&creator, key});
        mList.push_back(&creator);
        return true;
    }
    nvinfer1::IPluginCreatorInterface* const* getAllCreators(int32_t* const n) const noexcept override {
        if (n != nullptr) *n = static_cast<int32_t>(mList.size());
        return mList.data();
    }
    nvinfer1::IPluginCreatorInterface* getCreator(nvinfer1::AsciiChar const* const name,
                                                  nvinfer1::AsciiChar const* const version,
                                                  nvinfer1::AsciiChar const* const ns) noexcept override {
        std::string const key = std::string(name) + "/" + version + "/" + (ns != nullptr ? ns : "");
        for (Entry const& e : mEntries) {
            if (e.key == key) return e.creator;
        }
        return nullptr;
    }
    bool deregisterCreator(nvinfer1::IPluginCreatorInterface const&) noexcept override { return false; }
    nvinfer1::IPluginResource* acquirePluginResource(nvinfer1::AsciiChar const*,
                                                     nvinfer1::IPluginResource*) noexcept override {
        return nullptr;
    }
    int32_t releasePluginResource(nvinfer1::AsciiChar const*) noexcept override { return -1; }
    nvinfer1::IPluginCreatorInterface* const* getAllCreatorsRecursive(int32_t* const n) noexcept override {
        return getAllCreators(n);
    }

    int32_t count() const {
        std::lock_guard<std::mutex> lock(gMutex);
        return static_cast<int32_t>(mEntries.size());
    }

private:
    std::vector<Entry> mEntries;
    std::vector<nvinfer1::IPluginCreatorInterface*> mList;
};

StubLogger gLogger;
StubRegistry gRegistry;

}  // namespace

extern "C" TENSORRTAPI nvinfer1::IPluginRegistry* getPluginRegistry() noexcept { return &gRegistry; }
extern "C" TENSORRTAPI nvinfer1::ILogger* getLogger() noexcept { return &gLogger; }
extern "C" TENSORRTAPI int32_t getInferLibVersion() noexcept { return NV_TENSORRT_VERSION; }
extern "C" TENSORRTAPI int32_t getInferLibMajorVersion() noexcept { return NV_TENSORRT_MAJOR; }
extern "C" TENSORRTAPI int32_t getInferLibMinorVersion() noexcept { return NV_TENSORRT_MINOR; }
extern "C" TENSORRTAPI int32_t getInferLibPatchVersion() noexcept { return NV_TENSORRT_PATCH; }
extern "C" TENSORRTAPI int32_t getInferLibBuildVersion() noexcept { return NV_TENSORRT_BUILD; }

// Test hooks: how many creators were registered, how many errors were logged, the last message.
LZ_STUB_EXPORT int32_t lz_stub_registered_creators() { return gRegistry.count(); }
LZ_STUB_EXPORT int32_t lz_stub_logged_errors() {
    std::lock_guard<std::mutex> lock(gMutex);
    return gErrors;
}
LZ_STUB_EXPORT char const* lz_stub_last_message() {
    std::lock_guard<std::mutex> lock(gMutex);
    static thread_local std::string copy;
    copy = gLastMessage;
    return copy.c_str();
}
