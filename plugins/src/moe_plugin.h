// TensorRT 10+ plugin `layerzero::LayerZeroMoE` version "1" (IPluginV3 with the V3One capabilities).
//
// Inputs:  0 hidden [T, H], 1 router_logits [T, E], 2 w_gate [E, F, H], 3 w_up [E, F, H], 4 w_down [E, H, F];
//          one dtype for all five: kFLOAT, kHALF or kBF16, linear format.
// Outputs: 0 y [T, H] (dtype of hidden), 1 mask [T, E] kINT32 (IPluginV3OneBuild::getOutputDataTypes may not
//          return kBOOL; the ONNX lowering casts it to bool after the plugin).
// Fields:  top_k (int), normalize (int 0/1), scoring ("softmax" | "sigmoid"), activation ("silu" | "gelu" |
//          "relu"), zeroing_threshold (float); workspace_size (int64, optional: written by getFieldsToSerialize
//          so that enqueue knows the workspace TensorRT allocated). Strings arrive as kCHAR (the ONNX parser's form); ints may come
//          as any int type, floats as kFLOAT32/kFLOAT64; scoring/activation also as their int codes.
#pragma once

#include <NvInferRuntime.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace layerzero {

constexpr char const* kMoEPluginName = "LayerZeroMoE";
constexpr char const* kMoEPluginVersion = "1";
constexpr char const* kPluginNamespace = "layerzero";

struct MoEParams {
    int32_t topK{2};
    int32_t normalize{1};
    int32_t scoring{0};     // lz_scoring
    int32_t activation{0};  // lz_activation
    float zeroingThreshold{0.0F};
    int64_t workspaceBytes{0};  // what getWorkspaceSize returned at build time (field workspace_size); 0: unknown
};

// Set by setLoggerFinder (TensorRT calls it when it loads the library); may stay null.
extern std::atomic<nvinfer1::ILoggerFinder*> gLoggerFinder;

// Report through the logger TensorRT hands us (setLoggerFinder), else stderr.
void logMessage(nvinfer1::ILogger::Severity severity, std::string const& message) noexcept;

class MoEPlugin final : public nvinfer1::IPluginV3,
                        public nvinfer1::IPluginV3OneCore,
                        public nvinfer1::IPluginV3OneBuild,
                        public nvinfer1::IPluginV3OneRuntime {
public:
    MoEPlugin(MoEParams const& params, std::string name);
    MoEPlugin(MoEPlugin const&) = delete;  // the serialised fields point into mParams: clone() rebuilds them
    MoEPlugin& operator=(MoEPlugin const&) = delete;
    ~MoEPlugin() override = default;

    // IPluginV3
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
    nvinfer1::IPluginV3* clone() noexcept override;

    // IPluginV3OneCore
    char const* getPluginName() const noexcept override { return kMoEPluginName; }
    char const* getPluginVersion() const noexcept override { return kMoEPluginVersion; }
    char const* getPluginNamespace() const noexcept override { return kPluginNamespace; }

    // IPluginV3OneBuild
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
                            nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
                               nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
                            int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                            nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                   int32_t nbOutputs) noexcept override;
    int32_t getNbOutputs() const noexcept override { return 2; }
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                            nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;
    char const* getMetadataString() noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
                          int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
                    void const* const* inputs, void* const* outputs, void* workspace,
                    cudaStream_t stream) noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

    MoEParams const& params() const noexcept { return mParams; }

private:
    void report(std::string const& message) const noexcept;  // an error through the logger, naming the layer
    bool checkConfig(nvinfer1::DynamicPluginTensorDesc const* in, std::string& error) const;
    size_t workspaceFor(nvinfer1::DynamicPluginTensorDesc const* in) const noexcept;

    MoEParams mParams;
    std::string mName;
    mutable int64_t mWorkspaceBytes{0};  // set by configurePlugin / getWorkspaceSize (const in the interface)
    int64_t mSerialWorkspace{0};
    std::atomic<bool> mWarnedUnknownWorkspace{false};
    std::string mMetadata;
    std::vector<nvinfer1::PluginField> mSerialFields;
    nvinfer1::PluginFieldCollection mSerialCollection{};
};

class MoEPluginCreator final : public nvinfer1::IPluginCreatorV3One {
public:
    MoEPluginCreator();
    ~MoEPluginCreator() override = default;

    char const* getPluginName() const noexcept override { return kMoEPluginName; }
    char const* getPluginVersion() const noexcept override { return kMoEPluginVersion; }
    char const* getPluginNamespace() const noexcept override { return kPluginNamespace; }
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override { return &mCollection; }
    nvinfer1::IPluginV3* createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc,
                                      nvinfer1::TensorRTPhase phase) noexcept override;

private:
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mCollection{};
};

// Parse and validate the plugin fields; on failure returns false and says why in `error`.
bool parseMoEFields(nvinfer1::PluginFieldCollection const* fc, MoEParams& params, std::string& error) noexcept;

}  // namespace layerzero
