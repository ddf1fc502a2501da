// Lifecycle harness: drives liblayerzero_trt.so the way TensorRT 10 does, on a CPU, without TensorRT's engine.
//
//   lifecycle <path/to/liblayerzero_trt.so>       (libnvinfer.so.10, real or tests' stub, on LD_LIBRARY_PATH)
//
// Steps, in TensorRT's order: dlopen + setLoggerFinder + getCreators (IPluginRegistry::loadLibrary) -> the V3
// creator and its field names -> createPlugin with the ONNX parser's field types (kINT32, kFLOAT32, kCHAR) ->
// the core / build / runtime capability interfaces -> output types and shapes -> supportsFormatCombination over
// every (position, type, format) -> configurePlugin (dynamic T) -> getWorkspaceSize -> clone ->
// getFieldsToSerialize -> createPlugin(kRUNTIME) from those fields (a plan's deserialisation) -> attachToContext
// -> onShapeChange -> enqueue with T = 0; then the errors: bad fields, bad shapes, a bad profile, each of which
// must fail with a message that names the problem. Prints one line per step; exit 0 when every check passed,
// 1 at the first failure (the line says which), 2 when the library cannot be loaded.
#include <NvInferRuntime.h>

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

using namespace nvinfer1;

namespace {

int gChecks = 0;

[[noreturn]] void failNow(char const* step, std::string const& why) {
    std::printf("FAIL %s: %s\n", step, why.c_str());
    std::fflush(stdout);
    std::exit(1);
}

#define CHECK(step, cond, why)                                     \
    do {                                                           \
        ++gChecks;                                                 \
        if (!(cond)) failNow(step, std::string(#cond) + " -- " + (why)); \
    } while (0)

// What the plugin logs (TensorRT hands a plugin library its logger through setLoggerFinder).
class CapturingLogger final : public ILogger {
public:
    void log(Severity severity, AsciiChar const* msg) noexcept override {
        if (severity <= Severity::kERROR) {
            ++errors;
            last = msg != nullptr ? msg : "";
        }
    }
    int errors = 0;
    std::string last;
    // The errors logged since the last call, and the last such message.
    bool takeError(std::string& message) {
        bool const any = errors > 0;
        message = last;
        errors = 0;
        last.clear();
        return any;
    }
};

class Finder final : public ILoggerFinder {
public:
    explicit Finder(ILogger* logger) : mLogger(logger) {}
    ILogger* findLogger() override { return mLogger; }

private:
    ILogger* mLogger;
};

// Stand-ins for TensorRT's symbolic dims: the plugin copies expressions, it never evaluates them here.
class FakeExpr final : public IDimensionExpr {
public:
    FakeExpr() { mImpl = nullptr; }
};
class FakeBuilder final : public IExprBuilder {
public:
    FakeBuilder() { mImpl = nullptr; }
};

Dims dims(std::vector<int64_t> const& v) {
    Dims d{};
    d.nbDims = static_cast<int32_t>(v.size());
    for (size_t i = 0; i < v.size(); ++i) d.d[i] = v[i];
    return d;
}

struct Problem {
    int64_t T, H, F, E;
};

// The five inputs as TensorRT describes them to configurePlugin: desc dims (-1 where dynamic), min / opt / max.
std::vector<DynamicPluginTensorDesc> dynamicInputs(Problem const& p, int64_t tMin, int64_t tMax, DataType type,
                                                   bool dynamicLogitsE = false) {
    std::vector<std::vector<int64_t>> const shapes = {
        {p.T, p.H}, {p.T, p.E}, {p.E, p.F, p.H}, {p.E, p.F, p.H}, {p.E, p.H, p.F}};
    std::vector<DynamicPluginTensorDesc> in(5);
    for (int i = 0; i < 5; ++i) {
        std::vector<int64_t> desc = shapes[i], lo = shapes[i], hi = shapes[i];
        if (i < 2) {
            desc[0] = -1, lo[0] = tMin, hi[0] = tMax;
            if (i == 1 && dynamicLogitsE) desc[1] = -1;
        }
        in[i].desc.dims = dims(desc);
        in[i].desc.type = type;
        in[i].desc.format = TensorFormat::kLINEAR;
        in[i].desc.scale = 1.0F;
        in[i].min = dims(lo), in[i].opt = dims(hi), in[i].max = dims(hi);
    }
    return in;
}

std::vector<DynamicPluginTensorDesc> dynamicOutputs(Problem const& p, DataType type) {
    std::vector<DynamicPluginTensorDesc> out(2);
    out[0].desc.dims = dims({-1, p.H}), out[0].desc.type = type;
    out[1].desc.dims = dims({-1, p.E}), out[1].desc.type = DataType::kINT32;
    for (auto& o : out) o.desc.format = TensorFormat::kLINEAR, o.min = o.max = o.opt = o.desc.dims;
    return out;
}

std::vector<PluginTensorDesc> concrete(std::vector<DynamicPluginTensorDesc> const& in, int64_t T) {
    std::vector<PluginTensorDesc> out;
    for (auto const& d : in) {
        PluginTensorDesc c = d.desc;
        c.dims = d.max;
        if (&d - in.data() < 2) c.dims.d[0] = T;
        out.push_back(c);
    }
    return out;
}

// Fields as TensorRT's ONNX parser passes a node's attributes: INT -> kINT32, FLOAT -> kFLOAT32, STRING -> kCHAR
// (the bytes, without a terminator).
struct Fields {
    int32_t topK = 2, normalize = 1;
    std::string scoring = "softmax", activation = "silu";
    float threshold = 0.0F;
    std::vector<PluginField> list;
    PluginFieldCollection fc{};
    PluginFieldCollection const* get() {
        list.clear();
        list.emplace_back("top_k", &topK, PluginFieldType::kINT32, 1);
        list.emplace_back("normalize", &normalize, PluginFieldType::kINT32, 1);
        list.emplace_back("scoring", scoring.data(), PluginFieldType::kCHAR, static_cast<int32_t>(scoring.size()));
        list.emplace_back("activation", activation.data(), PluginFieldType::kCHAR,
                          static_cast<int32_t>(activation.size()));
        list.emplace_back("zeroing_threshold", &threshold, PluginFieldType::kFLOAT32, 1);
        fc.nbFields = static_cast<int32_t>(list.size());
        fc.fields = list.data();
        return &fc;
    }
};

struct PluginDeleter {
    void operator()(IPluginV3* p) const { delete p; }
};
using PluginPtr = std::unique_ptr<IPluginV3, PluginDeleter>;

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s liblayerzero_trt.so\n", argv[0]);
        return 2;
    }
    // 1. The registry's loadLibrary: dlopen, setLoggerFinder, getCreators.
    void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
        std::printf("FAIL load: %s\n", dlerror());
        return 2;
    }
    using SetLoggerFinder = void (*)(ILoggerFinder*);
    using GetCreators = IPluginCreatorInterface* const* (*)(int32_t&);
    auto setLoggerFinder = reinterpret_cast<SetLoggerFinder>(dlsym(lib, "setLoggerFinder"));
    auto getCreators = reinterpret_cast<GetCreators>(dlsym(lib, "getCreators"));
    CHECK("entry points", setLoggerFinder != nullptr && getCreators != nullptr, "setLoggerFinder/getCreators exported");
    CapturingLogger logger;
    Finder finder(&logger);
    setLoggerFinder(&finder);
    int32_t nbCreators = 0;
    IPluginCreatorInterface* const* creators = getCreators(nbCreators);
    CHECK("getCreators", nbCreators == 1 && creators != nullptr && creators[0] != nullptr, "one creator");
    InterfaceInfo const info = creators[0]->getInterfaceInfo();
    CHECK("creator kind", std::strcmp(info.kind, "PLUGIN CREATOR_V3ONE") == 0 && info.major == 1, info.kind);
    auto* creator = static_cast<IPluginCreatorV3One*>(creators[0]);
    CHECK("creator name", std::strcmp(creator->getPluginName(), "LayerZeroMoE") == 0, creator->getPluginName());
    CHECK("creator version", std::strcmp(creator->getPluginVersion(), "1") == 0, creator->getPluginVersion());
    CHECK("creator namespace", std::strcmp(creator->getPluginNamespace(), "layerzero") == 0,
          creator->getPluginNamespace());
    PluginFieldCollection const* names = creator->getFieldNames();
    CHECK("field names", names != nullptr && names->nbFields >= 5, "five fields");
    std::string listed;
    for (int32_t i = 0; i < names->nbFields; ++i) listed += std::string(names->fields[i].name) + " ";
    for (char const* want : {"top_k ", "normalize ", "scoring ", "activation ", "zeroing_threshold "})
        CHECK("field names", listed.find(want) != std::string::npos, listed);
    std::printf("ok   creator: %s v%s in %s, fields: %s\n", creator->getPluginName(), creator->getPluginVersion(),
                creator->getPluginNamespace(), listed.c_str());

    // 2. createPlugin with the parser's field types.
    Fields fields;
    fields.topK = 2, fields.threshold = 0.1F, fields.scoring = "sigmoid", fields.activation = "gelu";
    PluginPtr plugin(creator->createPlugin("layers.0.moe", fields.get(), TensorRTPhase::kBUILD));
    CHECK("createPlugin", plugin != nullptr, logger.last);
    std::string msg;
    CHECK("createPlugin", !logger.takeError(msg), msg);

    // 3. Capability interfaces.
    auto* core = static_cast<IPluginV3OneCore*>(plugin->getCapabilityInterface(PluginCapabilityType::kCORE));
    auto* build = static_cast<IPluginV3OneBuild*>(plugin->getCapabilityInterface(PluginCapabilityType::kBUILD));
    auto* runtime = static_cast<IPluginV3OneRuntime*>(plugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    CHECK("capabilities", core != nullptr && build != nullptr && runtime != nullptr, "core, build, runtime");
    CHECK("core kind", std::strcmp(core->getInterfaceInfo().kind, "PLUGIN_V3ONE_CORE") == 0, core->getInterfaceInfo().kind);
    CHECK("build kind", std::strcmp(build->getInterfaceInfo().kind, "PLUGIN_V3ONE_BUILD") == 0,
          build->getInterfaceInfo().kind);
    CHECK("runtime kind", std::strcmp(runtime->getInterfaceInfo().kind, "PLUGIN_V3ONE_RUNTIME") == 0,
          runtime->getInterfaceInfo().kind);
    CHECK("core name", std::strcmp(core->getPluginName(), "LayerZeroMoE") == 0 &&
                           std::strcmp(core->getPluginNamespace(), "layerzero") == 0, core->getPluginName());
    std::string const metadata = build->getMetadataString();
    CHECK("metadata", metadata.find("top_k=2") != std::string::npos && metadata.find("sigmoid") != std::string::npos &&
                          metadata.find("gelu") != std::string::npos, metadata);
    std::printf("ok   createPlugin(kINT32, kCHAR, kFLOAT32 fields): %s\n", metadata.c_str());

    // 4. Output types and shapes.
    CHECK("getNbOutputs", build->getNbOutputs() == 2, "2");
    for (DataType t : {DataType::kFLOAT, DataType::kHALF, DataType::kBF16}) {
        DataType inTypes[5] = {t, t, t, t, t};
        DataType outTypes[2] = {DataType::kINT8, DataType::kINT8};
        CHECK("getOutputDataTypes", build->getOutputDataTypes(outTypes, 2, inTypes, 5) == 0, "float types");
        CHECK("getOutputDataTypes", outTypes[0] == t && outTypes[1] == DataType::kINT32, "y as hidden, mask int32");
    }
    {
        DataType inTypes[5] = {DataType::kINT32, DataType::kINT32, DataType::kINT32, DataType::kINT32, DataType::kINT32};
        DataType outTypes[2];
        CHECK("getOutputDataTypes int32", build->getOutputDataTypes(outTypes, 2, inTypes, 5) != 0, "refused");
        CHECK("getOutputDataTypes int32", logger.takeError(msg) && msg.find("hidden") != std::string::npos, msg);
    }
    {
        FakeExpr e[8];
        FakeBuilder exprBuilder;
        DimsExprs in[5];
        int const ranks[5] = {2, 2, 3, 3, 3};
        int k = 0;
        for (int i = 0; i < 5; ++i) {
            in[i].nbDims = ranks[i];
            for (int j = 0; j < ranks[i]; ++j) in[i].d[j] = &e[k++ % 8];
        }
        DimsExprs out[2];
        CHECK("getOutputShapes", build->getOutputShapes(in, 5, nullptr, 0, out, 2, exprBuilder) == 0, logger.last);
        CHECK("getOutputShapes y", out[0].nbDims == 2 && out[0].d[0] == in[0].d[0] && out[0].d[1] == in[0].d[1],
              "y [T, H]");
        CHECK("getOutputShapes mask", out[1].nbDims == 2 && out[1].d[0] == in[0].d[0] && out[1].d[1] == in[1].d[1],
              "mask [T, E]");
        in[1].nbDims = 3;
        CHECK("getOutputShapes rank", build->getOutputShapes(in, 5, nullptr, 0, out, 2, exprBuilder) != 0, "refused");
        CHECK("getOutputShapes rank", logger.takeError(msg) && msg.find("rank") != std::string::npos, msg);
    }
    std::printf("ok   output types (fp32/fp16/bf16 -> same + int32 mask) and shapes ([T, H], [T, E])\n");

    // 5. supportsFormatCombination: TensorRT asks position by position, with the earlier positions fixed.
    Problem const p{16, 64, 96, 8};
    DataType const types[] = {DataType::kFLOAT, DataType::kHALF, DataType::kBF16, DataType::kINT32, DataType::kINT8,
                              DataType::kBOOL};
    TensorFormat const formats[] = {TensorFormat::kLINEAR, TensorFormat::kCHW32, TensorFormat::kHWC8};
    int accepted = 0, asked = 0;
    for (DataType first : {DataType::kFLOAT, DataType::kHALF, DataType::kBF16}) {
        std::vector<DynamicPluginTensorDesc> io = dynamicInputs(p, 1, 16, first);
        std::vector<DynamicPluginTensorDesc> outs = dynamicOutputs(p, first);
        io.insert(io.end(), outs.begin(), outs.end());
        for (int pos = 0; pos < 7; ++pos) {
            DynamicPluginTensorDesc const saved = io[pos];
            for (DataType t : types) {
                for (TensorFormat f : formats) {
                    io[pos].desc.type = t, io[pos].desc.format = f;
                    bool const want = f == TensorFormat::kLINEAR &&
                                      (pos == 0 ? (t == DataType::kFLOAT || t == DataType::kHALF || t == DataType::kBF16)
                                       : pos == 6 ? t == DataType::kINT32
                                                  : t == first);
                    bool const got = build->supportsFormatCombination(pos, io.data(), 5, 2);
                    ++asked, accepted += got;
                    CHECK("supportsFormatCombination", got == want,
                          "pos " + std::to_string(pos) + " type " + std::to_string(static_cast<int>(t)) + " format " +
                              std::to_string(static_cast<int>(f)));
                }
            }
            io[pos] = saved;
        }
        CHECK("supportsFormatCombination", !build->supportsFormatCombination(7, io.data(), 5, 2), "pos out of range");
    }
    std::printf("ok   supportsFormatCombination: %d of %d (position, type, format) combinations accepted\n", accepted,
                asked);

    // 6. configurePlugin with a dynamic T profile [1, 256], then the workspace for its max shapes.
    std::vector<DynamicPluginTensorDesc> in = dynamicInputs(p, 1, 256, DataType::kHALF);
    std::vector<DynamicPluginTensorDesc> out = dynamicOutputs(p, DataType::kHALF);
    CHECK("configurePlugin", build->configurePlugin(in.data(), 5, out.data(), 2) == 0, logger.last);
    size_t const workspace = build->getWorkspaceSize(in.data(), 5, out.data(), 2);
    // 256 tokens * top-2 * (F + H) fp32 rows dominate.
    CHECK("getWorkspaceSize", workspace >= size_t{256} * 2 * (96 + 64) * 4, std::to_string(workspace));
    CHECK("getWorkspaceSize", !logger.takeError(msg), msg);
    std::printf("ok   configurePlugin (T in [1, 256]) and getWorkspaceSize = %zu bytes\n", workspace);

    // 7. clone, serialise -> recreate (what a plan holds), attachToContext.
    PluginPtr cloned(plugin->clone());
    CHECK("clone", cloned != nullptr && cloned.get() != plugin.get(), "a new object");
    auto* clonedBuild = static_cast<IPluginV3OneBuild*>(cloned->getCapabilityInterface(PluginCapabilityType::kBUILD));
    CHECK("clone", metadata == clonedBuild->getMetadataString(), clonedBuild->getMetadataString());
    auto* clonedRuntime =
        static_cast<IPluginV3OneRuntime*>(cloned->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    PluginFieldCollection const* serial = clonedRuntime->getFieldsToSerialize();
    CHECK("getFieldsToSerialize", serial != nullptr && serial->nbFields >= 5, "fields");
    bool haveWorkspace = false;
    for (int32_t i = 0; i < serial->nbFields; ++i) {
        if (std::strcmp(serial->fields[i].name, "workspace_size") == 0) {
            haveWorkspace = serial->fields[i].type == PluginFieldType::kINT64 &&
                            *static_cast<int64_t const*>(serial->fields[i].data) == static_cast<int64_t>(workspace);
        }
    }
    CHECK("getFieldsToSerialize", haveWorkspace, "workspace_size = getWorkspaceSize's answer, kept by clone");
    PluginPtr restored(creator->createPlugin("layers.0.moe", serial, TensorRTPhase::kRUNTIME));
    CHECK("recreate", restored != nullptr, logger.last);
    auto* restoredRuntime =
        static_cast<IPluginV3OneRuntime*>(restored->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    auto* restoredBuild = static_cast<IPluginV3OneBuild*>(restored->getCapabilityInterface(PluginCapabilityType::kBUILD));
    CHECK("recreate", metadata == restoredBuild->getMetadataString(), restoredBuild->getMetadataString());
    PluginPtr attached(restoredRuntime->attachToContext(nullptr));
    CHECK("attachToContext", attached != nullptr && attached.get() != restored.get(), "a per-context copy");
    auto* ctx = static_cast<IPluginV3OneRuntime*>(attached->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    std::printf("ok   clone, getFieldsToSerialize -> createPlugin(kRUNTIME) (%d fields), attachToContext\n",
                serial->nbFields);

    // 8. onShapeChange and enqueue with T = 0 (no kernel runs, no device needed).
    std::vector<PluginTensorDesc> inT0 = concrete(in, 0);
    std::vector<PluginTensorDesc> outT0 = {out[0].desc, out[1].desc};
    outT0[0].dims.d[0] = 0, outT0[1].dims.d[0] = 0;
    CHECK("onShapeChange T=0", ctx->onShapeChange(inT0.data(), 5, outT0.data(), 2) == 0, logger.last);
    void const* inputs[5] = {nullptr, nullptr, nullptr, nullptr, nullptr};
    void* outputs[2] = {nullptr, nullptr};
    CHECK("enqueue T=0", ctx->enqueue(inT0.data(), outT0.data(), inputs, outputs, nullptr, nullptr) == 0, logger.last);
    std::vector<PluginTensorDesc> inT7 = concrete(in, 7);
    CHECK("onShapeChange T=7", ctx->onShapeChange(inT7.data(), 5, outT0.data(), 2) == 0, logger.last);
    std::printf("ok   onShapeChange (T = 0, 7), enqueue with T = 0\n");

    // 8b. enqueue hands the kernels the workspace TensorRT allocated (the serialised workspace_size), not what the
    // problem needs: a plan that recorded 512 bytes is refused before any kernel runs (no device touched).
    {
        Fields f;
        std::vector<PluginField> small(f.get()->fields, f.get()->fields + f.get()->nbFields);
        int64_t recorded = 512;
        small.emplace_back("workspace_size", &recorded, PluginFieldType::kINT64, 1);
        PluginFieldCollection fc{static_cast<int32_t>(small.size()), small.data()};
        PluginPtr tiny(creator->createPlugin("layers.5.moe", &fc, TensorRTPhase::kRUNTIME));
        CHECK("recorded workspace", tiny != nullptr, logger.last);
        auto* rt = static_cast<IPluginV3OneRuntime*>(tiny->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
        CHECK("recorded workspace", rt->onShapeChange(inT7.data(), 5, outT0.data(), 2) == 0, logger.last);
        // Never dereferenced: the size check comes first.
        void const* fakeIn[5] = {reinterpret_cast<void const*>(0x1000), reinterpret_cast<void const*>(0x2000),
                                 reinterpret_cast<void const*>(0x3000), reinterpret_cast<void const*>(0x4000),
                                 reinterpret_cast<void const*>(0x5000)};
        void* fakeOut[2] = {reinterpret_cast<void*>(0x6000), reinterpret_cast<void*>(0x7000)};
        CHECK("enqueue small workspace",
              rt->enqueue(inT7.data(), outT0.data(), fakeIn, fakeOut, reinterpret_cast<void*>(0x10000), nullptr) != 0,
              "refused");
        CHECK("enqueue small workspace", logger.takeError(msg) && msg.find("workspace has 512 bytes") != std::string::npos &&
                                             msg.find("layers.5.moe") != std::string::npos, msg);
    }
    std::printf("ok   enqueue passes the recorded workspace size (512 bytes: refused, nothing launched)\n");

    // 9. Errors: each refused, with a message that names what is wrong.
    struct BadField {
        char const* what;
        Fields fields;
        char const* expect;
    };
    std::vector<BadField> bad(6);
    bad[0] = {"top_k = 0", {}, "top_k"}, bad[0].fields.topK = 0;
    bad[1] = {"top_k = 33", {}, "top_k"}, bad[1].fields.topK = 33;
    bad[2] = {"scoring = 'argmax'", {}, "scoring"}, bad[2].fields.scoring = "argmax";
    bad[3] = {"activation = 'tanh'", {}, "activation"}, bad[3].fields.activation = "tanh";
    bad[4] = {"normalize = 2", {}, "normalize"}, bad[4].fields.normalize = 2;
    bad[5] = {"zeroing_threshold = -1", {}, "zeroing_threshold"}, bad[5].fields.threshold = -1.0F;
    for (BadField& b : bad) {
        PluginPtr refused(creator->createPlugin("layers.3.moe", b.fields.get(), TensorRTPhase::kBUILD));
        CHECK(b.what, refused == nullptr, "createPlugin refused");
        CHECK(b.what, logger.takeError(msg) && msg.find(b.expect) != std::string::npos &&
                          msg.find("layers.3.moe") != std::string::npos, msg);
    }
    {
        PluginFieldCollection none{};
        PluginPtr refused(creator->createPlugin("layers.3.moe", &none, TensorRTPhase::kBUILD));
        CHECK("no top_k", refused == nullptr && logger.takeError(msg) && msg.find("top_k is required") != std::string::npos,
              msg);
        int64_t wide = 4;  // an int64 top_k (a parser that keeps INT as kINT64) is accepted
        PluginField f("top_k", &wide, PluginFieldType::kINT64, 1);
        PluginFieldCollection one{1, &f};
        PluginPtr ok64(creator->createPlugin("layers.3.moe", &one, TensorRTPhase::kBUILD));
        CHECK("int64 top_k", ok64 != nullptr, logger.last);
    }
    std::printf("ok   bad fields refused with messages naming the field and the layer\n");

    Fields eight;
    eight.topK = 8;
    PluginPtr k8(creator->createPlugin("layers.4.moe", eight.get(), TensorRTPhase::kBUILD));
    auto* k8build = static_cast<IPluginV3OneBuild*>(k8->getCapabilityInterface(PluginCapabilityType::kBUILD));
    {
        Problem const small{16, 64, 96, 4};  // top_k = 8 > E = 4
        std::vector<DynamicPluginTensorDesc> i4 = dynamicInputs(small, 1, 16, DataType::kFLOAT);
        std::vector<DynamicPluginTensorDesc> o4 = dynamicOutputs(small, DataType::kFLOAT);
        CHECK("top_k > E", k8build->configurePlugin(i4.data(), 5, o4.data(), 2) != 0, "refused");
        CHECK("top_k > E", logger.takeError(msg) && msg.find("top_k = 8") != std::string::npos, msg);
        // E unknown (-1) in router_logits' desc, known from the weights: still checked.
        std::vector<DynamicPluginTensorDesc> i4d = dynamicInputs(small, 1, 16, DataType::kFLOAT, true);
        CHECK("top_k > E (E = -1 in logits)", k8build->configurePlugin(i4d.data(), 5, o4.data(), 2) != 0, "refused");
        CHECK("top_k > E (E = -1 in logits)", logger.takeError(msg) && msg.find("E = 4") != std::string::npos, msg);
        CHECK("getWorkspaceSize invalid", k8build->getWorkspaceSize(i4.data(), 5, o4.data(), 2) == 0, "nothing asked");
        CHECK("getWorkspaceSize invalid", logger.takeError(msg) && msg.find("top_k") != std::string::npos,
              "an invalid config is logged, not silent: " + msg);
    }
    {
        std::vector<DynamicPluginTensorDesc> wrongH = dynamicInputs(p, 1, 16, DataType::kFLOAT);
        wrongH[4].desc.dims.d[1] = 65, wrongH[4].max.d[1] = 65, wrongH[4].min.d[1] = 65;
        CHECK("inconsistent H", build->configurePlugin(wrongH.data(), 5, out.data(), 2) != 0, "refused");
        CHECK("inconsistent H", logger.takeError(msg) && msg.find("H (hidden size)") != std::string::npos &&
                                    msg.find("layer 'layers.0.moe'") != std::string::npos &&
                                    msg.find("w_down") != std::string::npos, msg);
        std::vector<DynamicPluginTensorDesc> mixed = dynamicInputs(p, 1, 16, DataType::kFLOAT);
        mixed[2].desc.type = DataType::kHALF;
        CHECK("mixed types", build->configurePlugin(mixed.data(), 5, out.data(), 2) != 0, "refused");
        CHECK("mixed types", logger.takeError(msg) && msg.find("w_gate") != std::string::npos, msg);
        std::vector<DynamicPluginTensorDesc> huge = dynamicInputs(p, 1, int64_t{1} << 31, DataType::kFLOAT);
        CHECK("profile too large", build->configurePlugin(huge.data(), 5, out.data(), 2) != 0, "refused");
        CHECK("profile too large", logger.takeError(msg) && msg.find("max shapes") != std::string::npos, msg);
        CHECK("configurePlugin 4 inputs", build->configurePlugin(in.data(), 4, out.data(), 2) != 0, "refused");
        CHECK("configurePlugin 4 inputs", logger.takeError(msg) && msg.find("5 inputs") != std::string::npos, msg);
        std::vector<PluginTensorDesc> badT = concrete(in, 7);
        badT[1].dims.d[0] = 6;
        CHECK("onShapeChange inconsistent T", ctx->onShapeChange(badT.data(), 5, outT0.data(), 2) != 0, "refused");
        CHECK("onShapeChange inconsistent T", logger.takeError(msg) && msg.find("T (tokens)") != std::string::npos, msg);
    }
    std::printf("ok   bad shapes refused in configurePlugin / getWorkspaceSize / onShapeChange with named inputs\n");

    std::printf("LIFECYCLE PASSED (%d checks)\n", gChecks);
    return 0;
}
