// run_bundle: run a LayerZero bundle from C++ through ONNX Runtime's C++ API, as a C++ service would.
//
//   run_bundle BUNDLE_DIR FEEDS.npz [--lib-dir DIR] [--masks] [--threads N]
//
// FEEDS.npz may hold layerzero::activation_scale (a float32 scalar; 0 runs an activation-sparse bundle dense).
//
// It loads BUNDLE_DIR/model.onnx, registers the custom-op libraries BUNDLE_DIR/manifest.json lists
// ("libraries": liblayerzero_ort.so for the native MoE op; looked for in --lib-dir, $LAYERZERO_PLUGIN_DIR,
// ~/.cache/layerzero/plugins), feeds every input from FEEDS.npz (np.savez: one array per input name), runs once
// and prints, as one JSON document, what `layerzero run BUNDLE --inputs FEEDS.npz --json` prints: the user outputs
// ({"shape", "dtype", "values"}), the zeroing report (the layers and parameters the compiler removed, from the
// manifest; the dynamic paths skipped on this request, from the `layerzero::mask::` outputs; the routing
// confidence, from the `layerzero::router::` outputs; the activation sparsity, per group of a bundle compiled with
// --activation-sparsity, from its `layerzero::mask::<group>` kept counts) and the latency.
//
// Bad input (a missing file, a malformed manifest or .npz, a missing or unknown input, a dtype or rank the model
// does not take) is one line on stderr and exit 2; ONNX Runtime's own failures are one line and exit 1.
#include <onnxruntime_cxx_api.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr const char* kMaskPrefix = "layerzero::mask::";
constexpr const char* kRouterPrefix = "layerzero::router::";
constexpr const char* kActivationScale = "layerzero::activation_scale";

struct BadInput : std::runtime_error {
  using std::runtime_error::runtime_error;
};

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// ------------------------------------------------------------------------------------------------------- JSON

// A JSON value: enough of the format for manifest.json (objects, arrays, strings, numbers, literals).
struct Json {
  enum Kind { Null, Bool, Number, String, Array, Object } kind = Null;
  bool b = false;
  double num = 0.0;
  bool integral = false;  // written without a fraction or an exponent
  std::string str;
  std::vector<Json> items;
  std::vector<std::pair<std::string, Json>> members;

  const Json* get(const std::string& key) const {
    if (kind != Object) return nullptr;
    for (const auto& [k, v] : members)
      if (k == key) return &v;
    return nullptr;
  }
};

class JsonParser {
 public:
  JsonParser(const std::string& text, std::string what) : s_(text), what_(std::move(what)) {}

  Json parse() {
    Json v = value();
    ws();
    if (i_ != s_.size()) fail("trailing characters");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& why) {
    throw BadInput(what_ + " is not valid JSON: " + why + " at byte " + std::to_string(i_));
  }
  void ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t')) ++i_;
  }
  bool eat(const char* word) {
    size_t n = std::strlen(word);
    if (s_.compare(i_, n, word) != 0) return false;
    i_ += n;
    return true;
  }
  Json value() {
    if (++depth_ > 256) fail("nested too deeply");
    ws();
    if (i_ >= s_.size()) fail("unexpected end");
    Json v;
    char c = s_[i_];
    if (c == '{') {
      v.kind = Json::Object;
      ++i_;
      ws();
      if (i_ < s_.size() && s_[i_] == '}') {
        ++i_;
      } else {
        for (;;) {
          ws();
          if (i_ >= s_.size() || s_[i_] != '"') fail("expected a key");
          std::string key = string();
          ws();
          if (i_ >= s_.size() || s_[i_] != ':') fail("expected ':'");
          ++i_;
          v.members.emplace_back(std::move(key), value());
          ws();
          if (i_ < s_.size() && s_[i_] == ',') { ++i_; continue; }
          if (i_ < s_.size() && s_[i_] == '}') { ++i_; break; }
          fail("expected ',' or '}'");
        }
      }
    } else if (c == '[') {
      v.kind = Json::Array;
      ++i_;
      ws();
      if (i_ < s_.size() && s_[i_] == ']') {
        ++i_;
      } else {
        for (;;) {
          v.items.push_back(value());
          ws();
          if (i_ < s_.size() && s_[i_] == ',') { ++i_; continue; }
          if (i_ < s_.size() && s_[i_] == ']') { ++i_; break; }
          fail("expected ',' or ']'");
        }
      }
    } else if (c == '"') {
      v.kind = Json::String;
      v.str = string();
    } else if (eat("true")) {
      v.kind = Json::Bool;
      v.b = true;
    } else if (eat("false")) {
      v.kind = Json::Bool;
    } else if (eat("null")) {
      v.kind = Json::Null;
    } else {
      size_t start = i_;
      if (s_[i_] == '-') ++i_;
      while (i_ < s_.size() && std::strchr("0123456789+-.eE", s_[i_]) != nullptr) ++i_;
      std::string token = s_.substr(start, i_ - start);
      if (token.empty() || token == "-") fail("unexpected character");
      char* end = nullptr;
      v.kind = Json::Number;
      v.num = std::strtod(token.c_str(), &end);
      if (end != token.c_str() + token.size()) fail("bad number '" + token + "'");
      v.integral = token.find_first_of(".eE") == std::string::npos;
    }
    --depth_;
    return v;
  }
  void utf8(uint32_t cp, std::string& out) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }
  uint32_t hex4() {
    if (i_ + 4 > s_.size()) fail("short \\u escape");
    uint32_t cp = 0;
    for (int k = 0; k < 4; ++k) {
      char h = s_[i_++];
      cp <<= 4;
      if (h >= '0' && h <= '9') cp |= h - '0';
      else if (h >= 'a' && h <= 'f') cp |= h - 'a' + 10;
      else if (h >= 'A' && h <= 'F') cp |= h - 'A' + 10;
      else fail("bad \\u escape");
    }
    return cp;
  }
  std::string string() {
    ++i_;  // the opening quote
    std::string out;
    for (;;) {
      if (i_ >= s_.size()) fail("unterminated string");
      char c = s_[i_++];
      if (c == '"') return out;
      if (c != '\\') { out += c; continue; }
      if (i_ >= s_.size()) fail("unterminated escape");
      char e = s_[i_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp < 0xDC00 && s_.compare(i_, 2, "\\u") == 0) {
            i_ += 2;
            uint32_t low = hex4();
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          }
          utf8(cp, out);
          break;
        }
        default: fail("bad escape");
      }
    }
  }

  const std::string& s_;
  std::string what_;
  size_t i_ = 0;
  int depth_ = 0;
};

// Writes JSON as Python's json.dumps reads back to the same values (floats: the shortest round-trip digits).
void write_string(std::ostream& out, const std::string& s) {
  out << '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out << "\\\""; break;
      case '\\': out << "\\\\"; break;
      case '\n': out << "\\n"; break;
      case '\r': out << "\\r"; break;
      case '\t': out << "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out << buf;
        } else {
          out << static_cast<char>(c);  // UTF-8 passes through
        }
    }
  }
  out << '"';
}

void write_double(std::ostream& out, double v) {
  if (std::isnan(v)) { out << "NaN"; return; }  // what json.dumps writes (and reads back)
  if (std::isinf(v)) { out << (v > 0 ? "Infinity" : "-Infinity"); return; }
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  std::string text(buf, end);
  if (text.find_first_of(".eEn") == std::string::npos) text += ".0";  // a float stays a float
  out << text;
}

// ------------------------------------------------------------------------------------------------------- .npz

struct Array {
  std::string dtype;  // numpy's name: float32, int64, bool, ...
  std::vector<int64_t> shape;
  std::vector<char> data;  // C order
};

std::string read_file(const std::string& path, const char* what) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw BadInput(std::string(what) + " " + path + " not found or not readable");
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

uint64_t le(const std::string& b, size_t at, int bytes, const std::string& what) {
  if (at + bytes > b.size()) throw BadInput(what + " is not a valid .npz file (truncated)");
  uint64_t v = 0;
  for (int k = bytes - 1; k >= 0; --k) v = (v << 8) | static_cast<unsigned char>(b[at + k]);
  return v;
}

// numpy dtype descr ("<f4", "|b1", ...) -> (name, item size); "" for what the example does not read.
std::pair<std::string, size_t> npy_dtype(const std::string& descr) {
  static const std::map<std::string, std::pair<std::string, size_t>> known = {
      {"<f4", {"float32", 4}}, {"<f8", {"float64", 8}}, {"<f2", {"float16", 2}}, {"<i8", {"int64", 8}},
      {"<i4", {"int32", 4}},   {"<i2", {"int16", 2}},   {"|i1", {"int8", 1}},    {"|u1", {"uint8", 1}},
      {"<u2", {"uint16", 2}},  {"<u4", {"uint32", 4}},  {"<u8", {"uint64", 8}},  {"|b1", {"bool", 1}},
  };
  auto it = known.find(descr);
  return it == known.end() ? std::pair<std::string, size_t>{"", 0} : it->second;
}

Array parse_npy(const std::string& b, const std::string& what) {
  if (b.size() < 10 || b.compare(0, 6, "\x93NUMPY") != 0) throw BadInput(what + " is not a .npy array");
  int major = static_cast<unsigned char>(b[6]);
  size_t header_len = major == 1 ? le(b, 8, 2, what) : le(b, 8, 4, what);
  size_t header_at = major == 1 ? 10 : 12;
  if (header_at + header_len > b.size()) throw BadInput(what + " is truncated");
  std::string h = b.substr(header_at, header_len);
  auto field = [&](const char* key) -> std::string {
    size_t k = h.find(std::string("'") + key + "'");
    if (k == std::string::npos) throw BadInput(what + " has no '" + key + "' in its header");
    size_t colon = h.find(':', k);
    size_t start = h.find_first_not_of(' ', colon + 1);
    if (h[start] == '(') return h.substr(start + 1, h.find(')', start) - start - 1);
    if (h[start] == '\'') return h.substr(start + 1, h.find('\'', start + 1) - start - 1);
    size_t end = h.find_first_of(",}", start);
    return h.substr(start, end - start);
  };
  Array a;
  std::string descr = field("descr");
  size_t item;
  std::tie(a.dtype, item) = npy_dtype(descr);
  if (a.dtype.empty()) throw BadInput(what + " has dtype " + descr + ", which run_bundle does not read");
  if (field("fortran_order").rfind("True", 0) == 0) throw BadInput(what + " is in Fortran order");
  std::stringstream dims(field("shape"));
  std::string dim;
  while (std::getline(dims, dim, ',')) {
    dim.erase(0, dim.find_first_not_of(' '));
    if (!dim.empty()) a.shape.push_back(std::stoll(dim));
  }
  size_t count = std::accumulate(a.shape.begin(), a.shape.end(), size_t{1},
                                 [](size_t x, int64_t d) { return x * static_cast<size_t>(d); });
  size_t at = header_at + header_len;
  if (b.size() - at != count * item) throw BadInput(what + " holds " + std::to_string(b.size() - at) +
                                                    " data bytes, its header says " + std::to_string(count * item));
  a.data.assign(b.begin() + at, b.end());
  return a;
}

// The arrays of an np.savez file: its central directory (ZIP64 aware) names each stored member.
std::map<std::string, Array> read_npz(const std::string& path) {
  std::string b = read_file(path, "feeds file");
  const std::string what = path;
  size_t eocd = b.size() >= 22 ? b.rfind(std::string("PK\x05\x06", 4)) : std::string::npos;
  if (eocd == std::string::npos) throw BadInput(path + " is not a .npz file (no zip directory)");
  uint64_t entries = le(b, eocd + 10, 2, what), cd_offset = le(b, eocd + 16, 4, what);
  if (cd_offset == 0xFFFFFFFFu || entries == 0xFFFF) {  // ZIP64: the locator precedes the record
    size_t locator = eocd >= 20 ? eocd - 20 : 0;
    if (le(b, locator, 4, what) != 0x07064b50) throw BadInput(path + " has a broken ZIP64 directory");
    size_t record = le(b, locator + 8, 8, what);
    entries = le(b, record + 32, 8, what);
    cd_offset = le(b, record + 48, 8, what);
  }
  std::map<std::string, Array> arrays;
  size_t at = cd_offset;
  for (uint64_t e = 0; e < entries; ++e) {
    if (le(b, at, 4, what) != 0x02014b50) throw BadInput(path + " has a broken zip directory");
    uint64_t method = le(b, at + 10, 2, what), size = le(b, at + 20, 4, what);
    uint64_t name_len = le(b, at + 28, 2, what), extra_len = le(b, at + 30, 2, what);
    uint64_t comment_len = le(b, at + 32, 2, what), local = le(b, at + 42, 4, what);
    std::string name = b.substr(at + 46, name_len);
    for (size_t x = at + 46 + name_len; x + 4 <= at + 46 + name_len + extra_len;) {  // ZIP64 sizes / offset
      uint64_t id = le(b, x, 2, what), len = le(b, x + 2, 2, what);
      if (id == 1) {
        size_t y = x + 4;
        if (le(b, at + 24, 4, what) == 0xFFFFFFFFu) y += 8;  // uncompressed size
        if (size == 0xFFFFFFFFu) { size = le(b, y, 8, what); y += 8; }
        if (local == 0xFFFFFFFFu) local = le(b, y, 8, what);
      }
      x += 4 + len;
    }
    if (method != 0)
      throw BadInput(path + ": member " + name + " is compressed (np.savez_compressed); write it with np.savez");
    if (le(b, local, 4, what) != 0x04034b50) throw BadInput(path + " has a broken zip member " + name);
    size_t data = local + 30 + le(b, local + 26, 2, what) + le(b, local + 28, 2, what);
    if (data + size > b.size()) throw BadInput(path + " is truncated");
    if (name.size() > 4 && name.compare(name.size() - 4, 4, ".npy") == 0) name.resize(name.size() - 4);
    arrays[name] = parse_npy(b.substr(data, size), path + ":" + name);
    at += 46 + name_len + extra_len + comment_len;
  }
  return arrays;
}

// --------------------------------------------------------------------------------------------- ONNX Runtime

ONNXTensorElementDataType ort_type(const std::string& dtype) {
  static const std::map<std::string, ONNXTensorElementDataType> types = {
      {"float32", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT},   {"float64", ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE},
      {"float16", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16}, {"int64", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64},
      {"int32", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32},     {"int16", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16},
      {"int8", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8},       {"uint8", ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8},
      {"uint16", ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16},   {"uint32", ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32},
      {"uint64", ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT64},   {"bool", ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL},
  };
  auto it = types.find(dtype);
  return it == types.end() ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED : it->second;
}

std::string dtype_name(ONNXTensorElementDataType t) {
  for (const char* name : {"float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "uint16",
                           "uint32", "uint64", "bool"})
    if (ort_type(name) == t) return name;
  return "";
}

double half_to_double(uint16_t h) {
  int sign = h >> 15, exp = (h >> 10) & 0x1F, frac = h & 0x3FF;
  double v;
  if (exp == 0) v = std::ldexp(frac, -24);
  else if (exp == 31) v = frac ? NAN : INFINITY;
  else v = std::ldexp(frac + 1024, exp - 25);
  return sign ? -v : v;
}

// Element k of a tensor as a double (the report's mask / router arithmetic), and as JSON (the outputs).
double element(const char* data, ONNXTensorElementDataType t, size_t k) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return reinterpret_cast<const float*>(data)[k];
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE: return reinterpret_cast<const double*>(data)[k];
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return half_to_double(reinterpret_cast<const uint16_t*>(data)[k]);
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: return static_cast<double>(reinterpret_cast<const int64_t*>(data)[k]);
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return reinterpret_cast<const int32_t*>(data)[k];
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16: return reinterpret_cast<const int16_t*>(data)[k];
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8: return reinterpret_cast<const int8_t*>(data)[k];
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return reinterpret_cast<const uint8_t*>(data)[k];
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16: return reinterpret_cast<const uint16_t*>(data)[k];
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32: return reinterpret_cast<const uint32_t*>(data)[k];
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT64: return static_cast<double>(reinterpret_cast<const uint64_t*>(data)[k]);
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL: return reinterpret_cast<const bool*>(data)[k] ? 1.0 : 0.0;
    default: return NAN;
  }
}

void write_element(std::ostream& out, const char* data, ONNXTensorElementDataType t, size_t k) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: write_double(out, element(data, t, k)); break;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL: out << (reinterpret_cast<const bool*>(data)[k] ? "true" : "false"); break;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: out << reinterpret_cast<const int64_t*>(data)[k]; break;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT64: out << reinterpret_cast<const uint64_t*>(data)[k]; break;
    default: out << static_cast<int64_t>(element(data, t, k));
  }
}

// Nested lists in C order, as numpy's tolist() writes them.
void write_values(std::ostream& out, const char* data, ONNXTensorElementDataType t, const std::vector<int64_t>& shape,
                  size_t axis, size_t& k) {
  if (axis == shape.size()) { write_element(out, data, t, k++); return; }
  out << '[';
  for (int64_t i = 0; i < shape[axis]; ++i) {
    if (i) out << ", ";
    write_values(out, data, t, shape, axis + 1, k);
  }
  out << ']';
}

std::string library_path(const std::string& name, const std::string& lib_dir) {
  std::vector<std::string> dirs;
  if (!lib_dir.empty()) dirs.push_back(lib_dir);
  if (const char* env = std::getenv("LAYERZERO_PLUGIN_DIR"); env && *env) dirs.emplace_back(env);
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  if (xdg && *xdg) dirs.push_back(std::string(xdg) + "/layerzero/plugins");
  else if (home) dirs.push_back(std::string(home) + "/.cache/layerzero/plugins");
  std::string searched;
  for (const auto& d : dirs) {
    std::string p = d + "/" + name;
    if (std::ifstream(p).good()) return p;
    searched += (searched.empty() ? "" : ", ") + d;
  }
  throw BadInput(name + " not found (searched " + searched + "); the bundle's manifest lists it: build it with "
                 "`layerzero plugins build --only ort` or pass --lib-dir");
}

// ---------------------------------------------------------------------------------------------------- report

struct Report {
  int64_t total_layers = 0;
  std::vector<std::string> zeroed_paths;
  std::vector<std::string> removed_scopes;  // every scope removed at compile time: whole layers and parts
  double zeroed_params_ratio = 0.0;
  int64_t params_before = 0;
  std::vector<std::string> skipped_paths;
  int64_t skipped_params = 0;
  bool has_confidence = false;
  double routing_confidence = 0.0;
  // Per activation-sparsity group, in output order: 1 - mean(kept) / channels over its token rows.
  std::vector<std::pair<std::string, double>> activation_sparsity;
};

bool is_int(const Json* v) { return v && v->kind == Json::Number && v->integral; }

Report static_report(const Json& manifest) {
  Report r;
  if (const Json* layers = manifest.get("layers"); layers && layers->kind == Json::Object) {
    if (const Json* zeroed = layers->get("zeroed"); zeroed && zeroed->kind == Json::Array)
      for (const auto& p : zeroed->items) r.zeroed_paths.push_back(p.kind == Json::String ? p.str : "");
    if (const Json* total = layers->get("total"); is_int(total)) r.total_layers = static_cast<int64_t>(total->num);
  }
  if (const Json* removed = manifest.get("removed"); removed && removed->kind == Json::Array)
    for (const auto& entry : removed->items)
      if (const Json* scope = entry.get("scope"); scope && scope->kind == Json::String)
        r.removed_scopes.push_back(scope->str);
  if (const Json* stats = manifest.get("stats"); stats && stats->kind == Json::Object) {
    const Json* before = stats->get("params_before");
    const Json* after = stats->get("params_after");
    if (before && after && before->kind == Json::Number && after->kind == Json::Number && before->num > 0)
      r.zeroed_params_ratio = std::max(0.0, 1.0 - after->num / before->num);
    if (before && before->kind == Json::Number && before->num > 0) r.params_before = static_cast<int64_t>(before->num);
  }
  return r;
}

// " and 1 part of a layer (model.layers.1.mlp)" for the removed scopes that are no whole layer, or "".
std::string removed_parts(const Report& r) {
  std::vector<std::string> parts;
  for (const auto& s : r.removed_scopes)
    if (std::find(r.zeroed_paths.begin(), r.zeroed_paths.end(), s) == r.zeroed_paths.end()) parts.push_back(s);
  if (parts.empty()) return "";
  std::string shown;
  for (size_t i = 0; i < parts.size() && i < 3; ++i) shown += (i ? ", " : "") + parts[i];
  if (parts.size() > 3) shown += ", \u2026 " + std::to_string(parts.size() - 3) + " more";
  return " and " + std::to_string(parts.size()) + (parts.size() == 1 ? " part of a layer (" : " parts of layers (") +
         shown + ")";
}

std::string summary(const Report& r) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "zeroed %zu/%lld layers", r.zeroed_paths.size(), static_cast<long long>(r.total_layers));
  std::string text = buf + removed_parts(r);
  std::snprintf(buf, sizeof buf, ", %.1f%% of parameters", r.zeroed_params_ratio * 100.0);
  text += buf;
  if (!r.skipped_paths.empty()) {
    size_t n = r.skipped_paths.size();
    text += "; skipped " + std::to_string(n) + (n != 1 ? " paths" : " path") + " on this request";
  }
  if (!r.activation_sparsity.empty()) {
    double sum = 0.0;  // in order, as Python's sum() adds
    for (const auto& [_, s] : r.activation_sparsity) sum += s;
    std::snprintf(buf, sizeof buf, "; activations %.1f%% zeroed (mean of %zu groups)",
                  sum / static_cast<double>(r.activation_sparsity.size()) * 100.0, r.activation_sparsity.size());
    text += buf;
  }
  if (r.has_confidence) {
    std::snprintf(buf, sizeof buf, "; routing confidence %.3f", r.routing_confidence);
    text += buf;
  }
  return text;
}

struct Args {
  std::string bundle, feeds, lib_dir;
  bool masks = false;
  int threads = 0;
};

Args parse_args(int argc, char** argv) {
  Args a;
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    if (s == "--lib-dir" && i + 1 < argc) a.lib_dir = argv[++i];
    else if (s == "--masks") a.masks = true;
    else if (s == "--threads" && i + 1 < argc) a.threads = std::atoi(argv[++i]);
    else if (s.rfind("--", 0) == 0) throw BadInput("unknown option " + s);
    else positional.push_back(s);
  }
  if (positional.size() != 2)
    throw BadInput("usage: run_bundle BUNDLE_DIR FEEDS.npz [--lib-dir DIR] [--masks] [--threads N]");
  a.bundle = positional[0];
  a.feeds = positional[1];
  return a;
}

int run(const Args& args) {
  const std::string manifest_path = args.bundle + "/manifest.json";
  Json manifest = JsonParser(read_file(manifest_path, "manifest"), manifest_path).parse();
  if (manifest.kind != Json::Object) throw BadInput(manifest_path + " is not a JSON object");
  std::map<std::string, Array> feeds = read_npz(args.feeds);

  Ort::Env env(ORT_LOGGING_LEVEL_ERROR, "run_bundle");  // warnings are not the user's errors
  Ort::SessionOptions options;
  if (args.threads > 0) options.SetIntraOpNumThreads(args.threads);
  if (const Json* libs = manifest.get("libraries"); libs && libs->kind == Json::Array)
    for (const auto& lib : libs->items) {
      if (lib.kind != Json::String || lib.str.find('/') != std::string::npos)
        throw BadInput(manifest_path + ": 'libraries' must list file names");
      options.RegisterCustomOpsLibrary(library_path(lib.str, args.lib_dir).c_str());
    }
  const std::string model_path = args.bundle + "/model.onnx";
  if (!std::ifstream(model_path).good()) throw BadInput(model_path + " not found");
  Ort::Session session(env, model_path.c_str(), options);
  Ort::AllocatorWithDefaultOptions allocator;
  Ort::MemoryInfo cpu = Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault);

  std::vector<std::string> input_names, output_names;
  std::vector<Ort::Value> inputs;
  for (size_t i = 0; i < session.GetInputCount(); ++i) {
    std::string name = session.GetInputNameAllocated(i, allocator).get();
    Ort::TypeInfo type_info = session.GetInputTypeInfo(i);  // owns what its tensor info points at
    auto info = type_info.GetTensorTypeAndShapeInfo();
    auto it = feeds.find(name);
    if (it == feeds.end()) {
      if (name == "layerzero::threshold") continue;  // optional: the compiled default
      throw BadInput("missing input '" + name + "' (" + dtype_name(info.GetElementType()) + ") in " + args.feeds);
    }
    Array& a = it->second;
    if (ort_type(a.dtype) != info.GetElementType())
      throw BadInput("input '" + name + "' is " + a.dtype + ", the model takes " + dtype_name(info.GetElementType()));
    std::vector<int64_t> dims = info.GetShape();
    if (dims.size() != a.shape.size())
      throw BadInput("input '" + name + "' has rank " + std::to_string(a.shape.size()) + ", the model takes rank " +
                     std::to_string(dims.size()));
    for (size_t d = 0; d < dims.size(); ++d)
      if (dims[d] >= 0 && dims[d] != a.shape[d])
        throw BadInput("input '" + name + "' has dim " + std::to_string(d) + " = " + std::to_string(a.shape[d]) +
                       ", the model takes " + std::to_string(dims[d]));
    inputs.push_back(Ort::Value::CreateTensor(cpu, a.data.data(), a.data.size(), a.shape.data(), a.shape.size(),
                                              info.GetElementType()));
    input_names.push_back(name);
  }
  // An initialized graph input (layerzero::activation_scale: 1 as compiled, 0 dense) is an overridable initializer
  // to ONNX Runtime, not an input: fed when FEEDS holds it, as `layerzero run` feeds it.
  for (size_t i = 0; i < session.GetOverridableInitializerCount(); ++i) {
    std::string name = session.GetOverridableInitializerNameAllocated(i, allocator).get();
    auto it = feeds.find(name);
    if (it == feeds.end()) continue;
    Ort::TypeInfo type_info = session.GetOverridableInitializerTypeInfo(i);
    auto info = type_info.GetTensorTypeAndShapeInfo();
    Array& a = it->second;
    if (name == kActivationScale) {
      if (a.dtype != "float32" || !a.shape.empty())
        throw BadInput("input '" + name + "' must be a float32 scalar (np.float32(s)), got " + a.dtype);
      float v;
      std::memcpy(&v, a.data.data(), sizeof v);
      if (!std::isfinite(v) || v < 0) throw BadInput("input '" + name + "': expected a finite number >= 0");
    }
    if (ort_type(a.dtype) != info.GetElementType())
      throw BadInput("input '" + name + "' is " + a.dtype + ", the model takes " + dtype_name(info.GetElementType()));
    if (info.GetShape().size() != a.shape.size())
      throw BadInput("input '" + name + "' has rank " + std::to_string(a.shape.size()) + ", the model takes rank " +
                     std::to_string(info.GetShape().size()));
    inputs.push_back(Ort::Value::CreateTensor(cpu, a.data.data(), a.data.size(), a.shape.data(), a.shape.size(),
                                              info.GetElementType()));
    input_names.push_back(name);
  }
  for (const auto& [name, _] : feeds)
    if (std::find(input_names.begin(), input_names.end(), name) == input_names.end() && name != "layerzero::threshold")
      throw BadInput("unknown input '" + name + "' in " + args.feeds);
  for (size_t i = 0; i < session.GetOutputCount(); ++i)
    output_names.push_back(session.GetOutputNameAllocated(i, allocator).get());

  std::vector<const char*> in_c, out_c;
  for (const auto& n : input_names) in_c.push_back(n.c_str());
  for (const auto& n : output_names) out_c.push_back(n.c_str());
  auto start = std::chrono::steady_clock::now();
  std::vector<Ort::Value> outputs =
      session.Run(Ort::RunOptions{nullptr}, in_c.data(), inputs.data(), inputs.size(), out_c.data(), out_c.size());
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();

  // The report: the manifest's static part, then each mask output's subpaths (a subpath whose mask column is
  // zero for every token was skipped) and the router outputs' mean top-1 probability.
  Report report = static_report(manifest);
  std::map<std::string, const Json*> dynamic;
  if (const Json* d = manifest.get("dynamic"); d && d->kind == Json::Array)
    for (const auto& e : d->items) {
      const Json *mask = e.get("mask_output"), *path = e.get("path"), *subpaths = e.get("subpaths"),
                 *params = e.get("params");
      if (mask && mask->kind == Json::String && path && path->kind == Json::String && subpaths &&
          subpaths->kind == Json::Array && !subpaths->items.empty() && params && params->kind == Json::Array)
        dynamic[mask->str] = &e;
    }
  double confidence_sum = 0.0;
  size_t confidence_count = 0;
  std::ostringstream masks_json;
  size_t masks_written = 0;
  for (size_t o = 0; o < output_names.size(); ++o) {
    const std::string& name = output_names[o];
    bool router = starts_with(name, kRouterPrefix), mask = starts_with(name, kMaskPrefix);
    if (!router && !mask) continue;
    auto info = outputs[o].GetTensorTypeAndShapeInfo();
    auto t = info.GetElementType();
    std::vector<int64_t> shape = info.GetShape();
    size_t n = info.GetElementCount();
    const char* data = static_cast<const char*>(outputs[o].GetTensorRawData());
    if (router) {
      for (size_t k = 0; k < n; ++k) confidence_sum += element(data, t, k);
      confidence_count += n;
      continue;
    }
    auto entry = dynamic.find(name);
    std::string path = entry != dynamic.end() ? entry->second->get("path")->str : name.substr(strlen(kMaskPrefix));
    if (args.masks) {
      masks_json << (masks_written++ ? ", " : "");
      write_string(masks_json, path);
      masks_json << ": ";
      size_t k = 0;
      write_values(masks_json, data, t, shape, 0, k);
    }
    if (entry == dynamic.end()) {
      bool any = false;
      for (size_t k = 0; k < n && !any; ++k) any = element(data, t, k) != 0.0;
      if (n && !any) report.skipped_paths.push_back(path);
      continue;
    }
    const auto& params = entry->second->get("params")->items;
    if (const Json* kind = entry->second->get("kind"); kind && kind->kind == Json::String && kind->str == "activation") {
      // An activation group (runtime/report.py _add_activation): each token row's kept channel count; the weight
      // rows of the zeroed channels are not read, so params x that fraction (rounded half to even, as Python's
      // round) count as skipped parameters.
      const Json* detail = entry->second->get("detail");
      const Json* channels = detail ? detail->get("channels") : nullptr;
      if (!n || !is_int(channels) || channels->num <= 0) continue;
      double kept = 0.0;  // integers: exact in a double, as numpy's float64 mean sums them
      for (size_t k = 0; k < n; ++k) kept += element(data, t, k);
      double zeroed = 1.0 - (kept / static_cast<double>(n)) / channels->num;
      report.activation_sparsity.emplace_back(path, zeroed);
      int64_t total = 0;
      for (const auto& p : params)
        if (p.kind == Json::Number) total += static_cast<int64_t>(p.num);
      report.skipped_params += static_cast<int64_t>(std::nearbyint(zeroed * static_cast<double>(total)));
      continue;
    }
    const auto& subpaths = entry->second->get("subpaths")->items;
    size_t columns = subpaths.size();
    for (size_t j = 0; j < columns; ++j) {
      bool any = false;
      for (size_t k = (columns == 1 ? 0 : j); k < n; k += (columns == 1 ? 1 : columns))
        if (element(data, t, k) != 0.0) { any = true; break; }
      if (any || (columns == 1 ? n == 0 : n / columns == 0)) continue;
      report.skipped_paths.push_back(subpaths[j].kind == Json::String ? subpaths[j].str : "");
      if (j < params.size() && params[j].kind == Json::Number) report.skipped_params += static_cast<int64_t>(params[j].num);
    }
  }
  if (confidence_count) {
    report.has_confidence = true;
    report.routing_confidence = confidence_sum / static_cast<double>(confidence_count);
  }
  if (report.skipped_params && report.params_before > 0)
    report.zeroed_params_ratio += static_cast<double>(report.skipped_params) / static_cast<double>(report.params_before);

  std::ostringstream out;
  out << "{\"outputs\": {";
  size_t written = 0;
  for (size_t o = 0; o < output_names.size(); ++o) {
    const std::string& name = output_names[o];
    if (starts_with(name, kRouterPrefix) || starts_with(name, kMaskPrefix)) continue;
    auto info = outputs[o].GetTensorTypeAndShapeInfo();
    std::vector<int64_t> shape = info.GetShape();
    out << (written++ ? ", " : "");
    write_string(out, name);
    out << ": {\"shape\": [";
    for (size_t d = 0; d < shape.size(); ++d) out << (d ? ", " : "") << shape[d];
    out << "], \"dtype\": \"" << dtype_name(info.GetElementType()) << "\", \"values\": ";
    size_t k = 0;
    write_values(out, static_cast<const char*>(outputs[o].GetTensorRawData()), info.GetElementType(), shape, 0, k);
    out << "}";
  }
  out << "}, \"report\": {\"total_layers\": " << report.total_layers
      << ", \"zeroed_layers\": " << report.zeroed_paths.size() << ", \"zeroed_params_ratio\": ";
  write_double(out, report.zeroed_params_ratio);
  auto write_list = [&out](const std::vector<std::string>& items) {
    out << '[';
    for (size_t i = 0; i < items.size(); ++i) {
      out << (i ? ", " : "");
      write_string(out, items[i]);
    }
    out << ']';
  };
  out << ", \"zeroed_paths\": ";
  write_list(report.zeroed_paths);
  out << ", \"skipped_paths\": ";
  write_list(report.skipped_paths);
  out << ", \"fallback_triggered\": false, \"routing_confidence\": ";
  if (report.has_confidence) write_double(out, report.routing_confidence);
  else out << "null";
  out << ", \"masks\": {" << masks_json.str() << "}, \"skipped_params\": " << report.skipped_params
      << ", \"params_before\": " << report.params_before << ", \"removed_scopes\": ";
  write_list(report.removed_scopes);
  out << ", \"summary\": ";
  write_string(out, summary(report));
  if (!report.activation_sparsity.empty()) {  // only a model with activation sparsity has the key, as in Python
    out << ", \"activation_sparsity\": {";
    for (size_t i = 0; i < report.activation_sparsity.size(); ++i) {
      out << (i ? ", " : "");
      write_string(out, report.activation_sparsity[i].first);
      out << ": ";
      write_double(out, report.activation_sparsity[i].second);
    }
    out << "}";
  }
  out << "}, \"latency_ms\": ";
  write_double(out, ms);
  out << "}\n";
  std::fputs(out.str().c_str(), stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse_args(argc, argv));
  } catch (const BadInput& e) {
    std::fprintf(stderr, "run_bundle: %s\n", e.what());
    return 2;
  } catch (const Ort::Exception& e) {
    std::string msg = e.what();
    std::replace(msg.begin(), msg.end(), '\n', ' ');
    std::fprintf(stderr, "run_bundle: ONNX Runtime: %s\n", msg.c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "run_bundle: %s\n", e.what());
    return 1;
  }
}
