// The LayerZeroMoE TensorRT plugin: shape/type logic and the glue to the kernels' C ABI.
#include "moe_plugin.h"

#include "layerzero_kernels.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <sstream>
#include <utility>

using nvinfer1::DataType;
using nvinfer1::Dims;
using nvinfer1::DimsExprs;
using nvinfer1::DynamicPluginTensorDesc;
using nvinfer1::ILogger;
using nvinfer1::PluginField;
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginFieldType;
using nvinfer1::PluginTensorDesc;

namespace layerzero {

// ------------------------------------------------------------------------------------------ logging

std::atomic<nvinfer1::ILoggerFinder*> gLoggerFinder{nullptr};

void logMessage(ILogger::Severity severity, std::string const& message) noexcept {
    std::string const text = std::string(kMoEPluginName) + ": " + message;
    nvinfer1::ILoggerFinder* finder = gLoggerFinder.load();
    ILogger* logger = finder != nullptr ? finder->findLogger() : nullptr;
    if (logger != nullptr) {
        logger->log(severity, text.c_str());
    } else if (severity <= ILogger::Severity::kWARNING) {
        std::fprintf(stderr, "[layerzero] %s\n", text.c_str());
    }
}

namespace {

void logError(std::string const& message) noexcept { logMessage(ILogger::Severity::kERROR, message); }

// ----------------------------------------------------------------------------------------- fields

char const* const kScoringNames[] = {"softmax", "sigmoid"};
char const* const kActivationNames[] = {"silu", "gelu", "relu"};

bool fieldInt(PluginField const& f, int64_t& out) {
    if (f.data == nullptr || f.length < 1) return false;
    switch (f.type) {
        case PluginFieldType::kINT32: out = *static_cast<int32_t const*>(f.data); return true;
        case PluginFieldType::kINT64: out = *static_cast<int64_t const*>(f.data); return true;
        case PluginFieldType::kINT16: out = *static_cast<int16_t const*>(f.data); return true;
        case PluginFieldType::kINT8: out = *static_cast<int8_t const*>(f.data); return true;
        default: return false;
    }
}

bool fieldFloat(PluginField const& f, double& out) {
    if (f.data == nullptr || f.length < 1) return false;
    switch (f.type) {
        case PluginFieldType::kFLOAT32: out = *static_cast<float const*>(f.data); return true;
        case PluginFieldType::kFLOAT64: out = *static_cast<double const*>(f.data); return true;
        default: {
            int64_t i = 0;
            if (!fieldInt(f, i)) return false;
            out = static_cast<double>(i);
            return true;
        }
    }
}

bool fieldString(PluginField const& f, std::string& out) {
    if (f.type != PluginFieldType::kCHAR || f.data == nullptr || f.length < 0) return false;
    out.assign(static_cast<char const*>(f.data), static_cast<size_t>(f.length));
    out.erase(std::find(out.begin(), out.end(), '\0'), out.end());  // with or without the terminator
    std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
    return true;
}

// A name from `names`, or its index given as an int field.
bool fieldEnum(PluginField const& f, char const* const* names, int32_t count, int32_t& out, std::string& error) {
    std::string text;
    int64_t code = 0;
    if (fieldString(f, text)) {
        for (int32_t i = 0; i < count; ++i) {
            if (text == names[i]) {
                out = i;
                return true;
            }
        }
    } else if (fieldInt(f, code) && code >= 0 && code < count) {
        out = static_cast<int32_t>(code);
        return true;
    }
    std::ostringstream msg;
    msg << "field " << f.name << " = '" << text << "' is not one of";
    for (int32_t i = 0; i < count; ++i) msg << (i ? ", " : " ") << names[i];
    error = msg.str();
    return false;
}

std::string describe(Dims const& d) {
    std::ostringstream s;
    s << "[";
    for (int32_t i = 0; i < d.nbDims; ++i) s << (i ? ", " : "") << d.d[i];
    s << "]";
    return s.str();
}

char const* const kInputNames[] = {"hidden", "router_logits", "w_gate", "w_up", "w_down"};

// Rank and cross-input consistency of the five inputs; -1 (a dim not known yet) matches anything.
bool checkShapes(Dims const* in, int32_t nbInputs, int32_t topK, std::string& error) {
    if (nbInputs != 5) {
        error = "expects 5 inputs (hidden, router_logits, w_gate, w_up, w_down), got " + std::to_string(nbInputs);
        return false;
    }
    int32_t const ranks[] = {2, 2, 3, 3, 3};
    for (int32_t i = 0; i < 5; ++i) {
        if (in[i].nbDims != ranks[i]) {
            error = std::string("input ") + kInputNames[i] + " must have rank " + std::to_string(ranks[i]) + ", got " +
                    describe(in[i]);
            return false;
        }
    }
    struct Use {
        int32_t input, axis;
    };
    struct Symbol {
        char const* name;
        std::vector<Use> uses;
    };
    Symbol const symbols[] = {
        {"T (tokens)", {{0, 0}, {1, 0}}},
        {"H (hidden size)", {{0, 1}, {2, 2}, {3, 2}, {4, 1}}},
        {"E (experts)", {{1, 1}, {2, 0}, {3, 0}, {4, 0}}},
        {"F (expert ffn size)", {{2, 1}, {3, 1}, {4, 2}}},
    };
    int64_t resolved[4] = {-1, -1, -1, -1};  // T, H, E, F: the first known value of each, from any input
    for (int32_t k = 0; k < 4; ++k) {
        Symbol const& s = symbols[k];
        int64_t value = -1;
        int32_t first = -1;
        for (Use const& u : s.uses) {
            int64_t const d = in[u.input].d[u.axis];
            if (d < 0) continue;
            if (value < 0) {
                value = d, first = u.input;
            } else if (d != value) {
                error = std::string("inconsistent ") + s.name + ": " + kInputNames[first] + " is " + describe(in[first]) +
                        " but " + kInputNames[u.input] + " is " + describe(in[u.input]) +
                        " (expected hidden [T, H], router_logits [T, E], w_gate/w_up [E, F, H], w_down [E, H, F])";
                return false;
            }
        }
        resolved[k] = value;
    }
    // E may be -1 in router_logits and known from the weights (or the other way round): check it wherever known.
    int64_t const experts = resolved[2];
    if (experts > LZ_MAX_EXPERTS) {
        error = "E = " + std::to_string(experts) + " experts is more than the kernels support (" +
                std::to_string(LZ_MAX_EXPERTS) + ")";
        return false;
    }
    if (experts == 0) {
        error = "E = 0 experts: router_logits and the weights need at least one";
        return false;
    }
    if (experts > 0 && topK > experts) {
        error = "top_k = " + std::to_string(topK) + " is larger than the number of experts E = " + std::to_string(experts);
        return false;
    }
    return true;
}

bool isFloatType(DataType t) { return t == DataType::kFLOAT || t == DataType::kHALF || t == DataType::kBF16; }

int32_t lzDtype(DataType t) {
    switch (t) {
        case DataType::kHALF: return LZ_DTYPE_F16;
        case DataType::kBF16: return LZ_DTYPE_BF16;
        default: return LZ_DTYPE_F32;
    }
}

lz_moe_config makeConfig(MoEParams const& p, Dims const* in) {
    lz_moe_config c{};
    c.tokens = in[0].d[0];
    c.hidden = in[0].d[1] >= 0 ? in[0].d[1] : in[2].d[2];
    c.ffn = in[2].d[1];
    c.experts = in[1].d[1] >= 0 ? in[1].d[1] : in[2].d[0];
    c.top_k = p.topK;
    c.normalize = p.normalize;
    c.scoring = p.scoring;
    c.activation = p.activation;
    c.zeroing_threshold = p.zeroingThreshold;
    return c;
}

constexpr size_t kWorkspaceAlign = 256;  // lz_moe_forward wants a 256-byte aligned workspace

}  // namespace

namespace {
bool fail(std::string& error, std::string message) {
    error = std::move(message);
    return false;
}
}  // namespace

bool parseMoEFields(PluginFieldCollection const* fc, MoEParams& params, std::string& error) noexcept {
    try {
        if (fc == nullptr || (fc->nbFields > 0 && fc->fields == nullptr)) {
            error = "no plugin fields given";
            return false;
        }
        bool haveTopK = false;
        for (int32_t i = 0; i < fc->nbFields; ++i) {
            PluginField const& f = fc->fields[i];
            std::string const name = f.name != nullptr ? f.name : "";
            int64_t iv = 0;
            double fv = 0.0;
            if (name == "top_k") {
                if (!fieldInt(f, iv)) return fail(error, "field top_k must be an int");
                params.topK = static_cast<int32_t>(iv);
                haveTopK = true;
            } else if (name == "normalize") {
                if (!fieldInt(f, iv)) return fail(error, "field normalize must be an int (0 or 1)");
                params.normalize = static_cast<int32_t>(iv);
            } else if (name == "scoring") {
                if (!fieldEnum(f, kScoringNames, 2, params.scoring, error)) return false;
            } else if (name == "activation") {
                if (!fieldEnum(f, kActivationNames, 3, params.activation, error)) return false;
            } else if (name == "zeroing_threshold") {
                if (!fieldFloat(f, fv)) return fail(error, "field zeroing_threshold must be a float");
                params.zeroingThreshold = static_cast<float>(fv);
            } else if (name == "workspace_size") {  // written by getFieldsToSerialize, not by the ONNX parser
                if (!fieldInt(f, iv) || iv < 0) return fail(error, "field workspace_size must be an int >= 0");
                params.workspaceBytes = iv;
            } else {
                logMessage(ILogger::Severity::kWARNING, "ignoring unknown plugin field '" + name + "'");
            }
        }
        if (!haveTopK) return fail(error, "field top_k is required");
        if (params.topK < 1 || params.topK > LZ_MAX_TOP_K)
            return fail(error,
                        "top_k = " + std::to_string(params.topK) + " must be in [1, " + std::to_string(LZ_MAX_TOP_K) + "]");
        if (params.normalize != 0 && params.normalize != 1)
            return fail(error, "normalize = " + std::to_string(params.normalize) + " must be 0 or 1");
        if (!(params.zeroingThreshold >= 0.0F) || std::isinf(params.zeroingThreshold))
            return fail(error, "zeroing_threshold must be finite and >= 0");
        return true;
    } catch (std::exception const& e) {
        error = e.what();
        return false;
    }
}

// ----------------------------------------------------------------------------------------- plugin

MoEPlugin::MoEPlugin(MoEParams const& params, std::string name)
    : mParams(params), mName(std::move(name)), mWorkspaceBytes(params.workspaceBytes) {
    std::ostringstream s;
    s << "top_k=" << mParams.topK << " normalize=" << mParams.normalize << " scoring=" << kScoringNames[mParams.scoring]
      << " activation=" << kActivationNames[mParams.activation] << " zeroing_threshold=" << mParams.zeroingThreshold;
    mMetadata = s.str();
}

void MoEPlugin::report(std::string const& message) const noexcept {
    try {
        logError(mName.empty() ? message : "layer '" + mName + "': " + message);
    } catch (...) {  // out of memory while naming the layer: report without the name
        logError(message);
    }
}

nvinfer1::IPluginCapability* MoEPlugin::getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept {
    switch (type) {
        case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
        case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuild*>(this);
        case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
    }
    return nullptr;
}

nvinfer1::IPluginV3* MoEPlugin::clone() noexcept {
    try {
        MoEParams params = mParams;
        params.workspaceBytes = mWorkspaceBytes;
        return new MoEPlugin(params, mName);
    } catch (std::exception const& e) {
        report(std::string("clone failed: ") + e.what());
        return nullptr;
    }
}

int32_t MoEPlugin::getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                                      int32_t nbInputs) const noexcept {
    if (nbInputs != 5 || nbOutputs != 2) {
        report("expects 5 inputs and 2 outputs, got " + std::to_string(nbInputs) + " and " + std::to_string(nbOutputs));
        return 1;
    }
    if (!isFloatType(inputTypes[0])) {
        report("hidden must be float32, float16 or bfloat16");
        return 1;
    }
    outputTypes[0] = inputTypes[0];
    outputTypes[1] = DataType::kINT32;  // kBOOL is not a legal plugin output type
    return 0;
}

int32_t MoEPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
                                   int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
                                   nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept {
    if (nbInputs != 5 || nbOutputs != 2) {
        report("expects 5 inputs and 2 outputs, got " + std::to_string(nbInputs) + " and " + std::to_string(nbOutputs));
        return 1;
    }
    if (inputs[0].nbDims != 2 || inputs[1].nbDims != 2) {
        report("hidden and router_logits must be rank 2 ([T, H] and [T, E])");
        return 1;
    }
    outputs[0] = inputs[0];
    outputs[1].nbDims = 2;
    outputs[1].d[0] = inputs[0].d[0];
    outputs[1].d[1] = inputs[1].d[1];
    return 0;
}

bool MoEPlugin::supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                          int32_t nbOutputs) noexcept {
    if (nbInputs != 5 || nbOutputs != 2 || pos < 0 || pos >= nbInputs + nbOutputs) return false;
    PluginTensorDesc const& d = inOut[pos].desc;
    if (d.format != nvinfer1::TensorFormat::kLINEAR) return false;
    if (pos == 0) return isFloatType(d.type);
    if (pos == nbInputs + 1) return d.type == DataType::kINT32;  // mask
    return d.type == inOut[0].desc.type;                           // logits, weights and y share hidden's type
}

int32_t MoEPlugin::configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs,
                                   DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept {
    // Build time: validate here, so a bad model fails the engine build naming the layer, not the first enqueue.
    if (nbInputs != 5 || nbOutputs != 2 || in == nullptr) {
        report("expects 5 inputs (hidden, router_logits, w_gate, w_up, w_down) and 2 outputs (y, mask), got " +
                 std::to_string(nbInputs) + " and " + std::to_string(nbOutputs));
        return 1;
    }
    std::string error;
    if (!checkConfig(in, error)) {
        report(error);
        return 1;
    }
    // What getWorkspaceSize will ask for: remembered (and serialised) so that enqueue passes the size it got.
    mWorkspaceBytes = static_cast<int64_t>(workspaceFor(in));
    return 0;
}

bool MoEPlugin::checkConfig(DynamicPluginTensorDesc const* in, std::string& error) const {
    Dims desc[5], lo[5], hi[5];
    for (int32_t i = 0; i < 5; ++i) desc[i] = in[i].desc.dims, lo[i] = in[i].min, hi[i] = in[i].max;
    if (!checkShapes(desc, 5, mParams.topK, error)) return false;
    if (!checkShapes(lo, 5, mParams.topK, error) || !checkShapes(hi, 5, mParams.topK, error)) {
        error = "profile shapes: " + error;
        return false;
    }
    for (int32_t i = 1; i < 5; ++i) {
        if (in[i].desc.type != in[0].desc.type) {
            error = std::string("input ") + kInputNames[i] + " must have hidden's data type";
            return false;
        }
    }
    // The largest problem of the profile must be one the kernels accept (sizes, top_k <= E, T * top_k < 2^31).
    lz_moe_config const cfg = makeConfig(mParams, hi);
    if (lz_moe_check_config(&cfg) != LZ_OK) {
        error = std::string("the profile's max shapes are not a valid MoE: ") + lz_last_error();
        return false;
    }
    return true;
}

size_t MoEPlugin::workspaceFor(DynamicPluginTensorDesc const* in) const noexcept {
    Dims dims[5];
    for (int32_t i = 0; i < 5; ++i) dims[i] = in[i].max;
    lz_moe_config const cfg = makeConfig(mParams, dims);
    size_t const bytes = lz_moe_workspace_size(&cfg);
    return bytes == 0 ? 0 : bytes + kWorkspaceAlign;
}

size_t MoEPlugin::getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                                   DynamicPluginTensorDesc const* /*outputs*/, int32_t nbOutputs) const noexcept {
    // No status to return: an invalid config is logged as an error (TensorRT also gets it from configurePlugin)
    // and asks for nothing; enqueue then refuses the call rather than run in a workspace too small.
    std::string error;
    if (nbInputs != 5 || nbOutputs != 2 || inputs == nullptr) {
        report("getWorkspaceSize: expects 5 inputs and 2 outputs, got " + std::to_string(nbInputs) + " and " +
                 std::to_string(nbOutputs));
        return 0;
    }
    if (!checkConfig(inputs, error)) {
        report("getWorkspaceSize: " + error);
        return 0;
    }
    size_t const bytes = workspaceFor(inputs);
    mWorkspaceBytes = static_cast<int64_t>(bytes);
    return bytes;
}

char const* MoEPlugin::getMetadataString() noexcept { return mMetadata.c_str(); }

int32_t MoEPlugin::onShapeChange(PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* /*out*/,
                                 int32_t nbOutputs) noexcept {
    if (nbOutputs != 2 || nbInputs != 5 || in == nullptr) {
        report("expects 5 inputs and 2 outputs, got " + std::to_string(nbInputs) + " and " +
                 std::to_string(nbOutputs));
        return 1;
    }
    Dims dims[5];
    for (int32_t i = 0; i < 5; ++i) dims[i] = in[i].dims;
    std::string error;
    if (!checkShapes(dims, nbInputs, mParams.topK, error)) {
        report(error);
        return 1;
    }
    lz_moe_config const cfg = makeConfig(mParams, dims);
    if (lz_moe_check_config(&cfg) != LZ_OK) {
        report(std::string("onShapeChange: ") + lz_last_error());
        return 1;
    }
    return 0;
}

int32_t MoEPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /*outputDesc*/,
                           void const* const* inputs, void* const* outputs, void* workspace,
                           cudaStream_t stream) noexcept {
    Dims dims[5];
    for (int32_t i = 0; i < 5; ++i) dims[i] = inputDesc[i].dims;
    lz_moe_config const cfg = makeConfig(mParams, dims);
    auto const raw = reinterpret_cast<uintptr_t>(workspace);
    uintptr_t const aligned = (raw + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
    // The size TensorRT allocated is what getWorkspaceSize returned at build time (kept in mWorkspaceBytes and
    // serialised with the plan); the kernels check the actual problem against it, after the alignment slack.
    size_t got = 0;
    if (mWorkspaceBytes > 0) {
        size_t const slack = aligned - raw;
        got = static_cast<size_t>(mWorkspaceBytes) > slack ? static_cast<size_t>(mWorkspaceBytes) - slack : 0;
    } else {
        // A plan without the field (built by a LayerZero before it was serialised): the kernels cannot check.
        got = lz_moe_workspace_size(&cfg);
        bool expected = false;
        if (mWarnedUnknownWorkspace.compare_exchange_strong(expected, true)) {
            logMessage(ILogger::Severity::kWARNING, "workspace size unknown (plan without 'workspace_size'); "
                                                    "rebuild the engine so the kernels can check it");
        }
    }
    int32_t const status = lz_moe_forward(&cfg, lzDtype(inputDesc[0].type), inputs[0], inputs[1], inputs[2],
                                          inputs[3], inputs[4], outputs[0], static_cast<int32_t*>(outputs[1]),
                                          workspace == nullptr ? nullptr : reinterpret_cast<void*>(aligned), got,
                                          reinterpret_cast<lz_stream_t>(stream));
    if (status != LZ_OK) {
        report(std::string("enqueue failed (") + lz_status_string(status) + "): " + lz_last_error());
        return status;
    }
    return 0;
}

nvinfer1::IPluginV3* MoEPlugin::attachToContext(nvinfer1::IPluginResourceContext* /*context*/) noexcept {
    return clone();  // no per-context resources: the workspace comes from TensorRT
}

PluginFieldCollection const* MoEPlugin::getFieldsToSerialize() noexcept {
    mSerialFields.clear();
    mSerialFields.emplace_back("top_k", &mParams.topK, PluginFieldType::kINT32, 1);
    mSerialFields.emplace_back("normalize", &mParams.normalize, PluginFieldType::kINT32, 1);
    char const* scoring = kScoringNames[mParams.scoring];
    char const* activation = kActivationNames[mParams.activation];
    mSerialFields.emplace_back("scoring", scoring, PluginFieldType::kCHAR, static_cast<int32_t>(std::strlen(scoring)));
    mSerialFields.emplace_back("activation", activation, PluginFieldType::kCHAR,
                               static_cast<int32_t>(std::strlen(activation)));
    mSerialFields.emplace_back("zeroing_threshold", &mParams.zeroingThreshold, PluginFieldType::kFLOAT32, 1);
    if (mWorkspaceBytes > 0) {
        mSerialWorkspace = mWorkspaceBytes;
        mSerialFields.emplace_back("workspace_size", &mSerialWorkspace, PluginFieldType::kINT64, 1);
    }
    mSerialCollection.nbFields = static_cast<int32_t>(mSerialFields.size());
    mSerialCollection.fields = mSerialFields.data();
    return &mSerialCollection;
}

// ---------------------------------------------------------------------------------------- creator

MoEPluginCreator::MoEPluginCreator() {
    mFields.emplace_back("top_k", nullptr, PluginFieldType::kINT32, 1);
    mFields.emplace_back("normalize", nullptr, PluginFieldType::kINT32, 1);
    mFields.emplace_back("scoring", nullptr, PluginFieldType::kCHAR, 0);
    mFields.emplace_back("activation", nullptr, PluginFieldType::kCHAR, 0);
    mFields.emplace_back("zeroing_threshold", nullptr, PluginFieldType::kFLOAT32, 1);
    mCollection.nbFields = static_cast<int32_t>(mFields.size());
    mCollection.fields = mFields.data();
}

nvinfer1::IPluginV3* MoEPluginCreator::createPlugin(char const* name, PluginFieldCollection const* fc,
                                                    nvinfer1::TensorRTPhase /*phase*/) noexcept {
    MoEParams params;
    std::string error;
    if (!parseMoEFields(fc, params, error)) {
        logError(std::string("cannot create plugin '") + (name != nullptr ? name : "") + "': " + error);
        return nullptr;
    }
    try {
        return new MoEPlugin(params, name != nullptr ? name : "");
    } catch (std::exception const& e) {
        logError(std::string("cannot create plugin: ") + e.what());
        return nullptr;
    }
}

}  // namespace layerzero
