// Load a LayerZero TensorRT plan together with the plugin library and run one inference.
//
//   run_plan model.lz/model.plan build/plugins/liblayerzero_trt.so hidden:16,256
//
// Inputs get seeded random values (floats) or zeros (ints); every output is printed as shape, dtype and a
// summary (mean and max |x| of floats, the fraction of true in bool masks: the experts that ran).
#include <NvInferRuntime.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

class Logger : public nvinfer1::ILogger {
public:
    void log(Severity severity, char const* msg) noexcept override {
        if (severity <= Severity::kWARNING) std::cerr << "[TensorRT] " << msg << "\n";
    }
};

#define CHECK_CUDA(call)                                                                      \
    do {                                                                                      \
        cudaError_t const err_ = (call);                                                      \
        if (err_ != cudaSuccess) {                                                            \
            std::cerr << #call << " failed: " << cudaGetErrorString(err_) << "\n";           \
            std::exit(1);                                                                     \
        }                                                                                     \
    } while (0)

size_t elementSize(nvinfer1::DataType t) {
    switch (t) {
        case nvinfer1::DataType::kFLOAT:
        case nvinfer1::DataType::kINT32: return 4;
        case nvinfer1::DataType::kINT64: return 8;
        case nvinfer1::DataType::kHALF:
        case nvinfer1::DataType::kBF16: return 2;
        default: return 1;  // kBOOL, kINT8, kUINT8, kFP8
    }
}

int64_t volume(nvinfer1::Dims const& d) {
    int64_t v = 1;
    for (int32_t i = 0; i < d.nbDims; ++i) v *= d.d[i];
    return v;
}

std::string describe(nvinfer1::Dims const& d) {
    std::ostringstream s;
    s << "[";
    for (int32_t i = 0; i < d.nbDims; ++i) s << (i ? ", " : "") << d.d[i];
    return s.str() + "]";
}

// "name:16,256" -> {name, [16, 256]}
bool parseShape(std::string const& arg, std::string& name, nvinfer1::Dims& dims) {
    auto const colon = arg.rfind(':');
    if (colon == std::string::npos) return false;
    name = arg.substr(0, colon);
    std::stringstream in(arg.substr(colon + 1));
    std::string item;
    dims.nbDims = 0;
    while (std::getline(in, item, ',') && dims.nbDims < nvinfer1::Dims::MAX_DIMS) dims.d[dims.nbDims++] = std::stoll(item);
    return dims.nbDims > 0;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 3) {
        std::cerr << "usage: " << argv[0] << " model.plan liblayerzero_trt.so [input:d0,d1 ...]\n";
        return 2;
    }
    std::map<std::string, nvinfer1::Dims> shapes;
    for (int i = 3; i < argc; ++i) {
        std::string name;
        nvinfer1::Dims dims{};
        if (!parseShape(argv[i], name, dims)) {
            std::cerr << "bad shape '" << argv[i] << "': expected NAME:D0,D1\n";
            return 2;
        }
        shapes[name] = dims;
    }

    Logger logger;
    std::unique_ptr<nvinfer1::IRuntime> runtime{nvinfer1::createInferRuntime(logger)};
    // The plugin library exports getCreators(): the registry loads it like trtexec --dynamicPlugins does.
    if (runtime->getPluginRegistry().loadLibrary(argv[2]) == nullptr) {
        std::cerr << "cannot load the plugin library " << argv[2] << "\n";
        return 1;
    }
    std::ifstream file(argv[1], std::ios::binary);
    std::vector<char> plan((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
    if (plan.empty()) {
        std::cerr << "cannot read " << argv[1] << "\n";
        return 1;
    }
    std::unique_ptr<nvinfer1::ICudaEngine> engine{runtime->deserializeCudaEngine(plan.data(), plan.size())};
    if (!engine) return 1;
    std::unique_ptr<nvinfer1::IExecutionContext> context{engine->createExecutionContext()};

    std::mt19937 rng(0);
    std::normal_distribution<float> normal;
    std::vector<void*> buffers;
    std::vector<std::string> outputs;
    for (int32_t i = 0; i < engine->getNbIOTensors(); ++i) {
        char const* name = engine->getIOTensorName(i);
        if (engine->getTensorIOMode(name) != nvinfer1::TensorIOMode::kINPUT) {
            outputs.emplace_back(name);
            continue;
        }
        nvinfer1::Dims dims = engine->getTensorShape(name);
        if (shapes.count(name)) dims = shapes[name];
        for (int32_t d = 0; d < dims.nbDims; ++d) {
            if (dims.d[d] < 0) {
                std::cerr << "input " << name << " has dynamic shape " << describe(dims) << ": pass " << name
                          << ":D0,D1\n";
                return 2;
            }
        }
        if (!context->setInputShape(name, dims)) return 1;
        nvinfer1::DataType const type = engine->getTensorDataType(name);
        size_t const count = static_cast<size_t>(volume(dims));
        std::vector<uint8_t> host(count * elementSize(type), 0);
        if (type == nvinfer1::DataType::kFLOAT) {
            auto* p = reinterpret_cast<float*>(host.data());
            for (size_t k = 0; k < count; ++k) p[k] = normal(rng);
        } else if (type == nvinfer1::DataType::kHALF) {
            auto* p = reinterpret_cast<__half*>(host.data());
            for (size_t k = 0; k < count; ++k) p[k] = __float2half(normal(rng));
        }
        void* device = nullptr;
        CHECK_CUDA(cudaMalloc(&device, host.size() ? host.size() : 1));
        CHECK_CUDA(cudaMemcpy(device, host.data(), host.size(), cudaMemcpyHostToDevice));
        context->setTensorAddress(name, device);
        buffers.push_back(device);
        std::cout << "input  " << name << " " << describe(dims) << "\n";
    }
    std::vector<std::pair<void*, size_t>> outputBuffers;
    for (auto const& name : outputs) {
        nvinfer1::Dims const dims = context->getTensorShape(name.c_str());
        size_t const bytes = static_cast<size_t>(volume(dims)) * elementSize(engine->getTensorDataType(name.c_str()));
        void* device = nullptr;
        CHECK_CUDA(cudaMalloc(&device, bytes ? bytes : 1));
        context->setTensorAddress(name.c_str(), device);
        outputBuffers.emplace_back(device, bytes);
        buffers.push_back(device);
    }

    cudaStream_t stream;
    CHECK_CUDA(cudaStreamCreate(&stream));
    if (!context->enqueueV3(stream)) {
        std::cerr << "enqueueV3 failed\n";
        return 1;
    }
    CHECK_CUDA(cudaStreamSynchronize(stream));

    for (size_t o = 0; o < outputs.size(); ++o) {
        char const* name = outputs[o].c_str();
        nvinfer1::Dims const dims = context->getTensorShape(name);
        nvinfer1::DataType const type = engine->getTensorDataType(name);
        std::vector<uint8_t> host(outputBuffers[o].second);
        CHECK_CUDA(cudaMemcpy(host.data(), outputBuffers[o].first, host.size(), cudaMemcpyDeviceToHost));
        size_t const count = static_cast<size_t>(volume(dims));
        std::cout << "output " << name << " " << describe(dims);
        if (type == nvinfer1::DataType::kFLOAT || type == nvinfer1::DataType::kHALF) {
            double sum = 0, maxAbs = 0;
            for (size_t k = 0; k < count; ++k) {
                double const v = type == nvinfer1::DataType::kFLOAT ? reinterpret_cast<float*>(host.data())[k]
                                                                    : __half2float(reinterpret_cast<__half*>(host.data())[k]);
                sum += v;
                maxAbs = std::max(maxAbs, std::abs(v));
            }
            std::cout << " mean " << (count ? sum / count : 0.0) << " max|x| " << maxAbs;
        } else if (type == nvinfer1::DataType::kBOOL) {
            size_t on = 0;
            for (size_t k = 0; k < count; ++k) on += host[k] != 0;
            std::cout << " true " << on << "/" << count << " (experts that ran)";
        }
        std::cout << "\n";
    }
    for (void* p : buffers) cudaFree(p);
    cudaStreamDestroy(stream);
    return 0;
}
