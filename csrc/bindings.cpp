// cosa._C: the remap layer (remap.hpp) on numpy int32 arrays, and libcosa's kernel
// launchers (kernels.hpp) for Python's run.
//
// Calls keep the GIL: the input arrays are borrowed, and another thread
// changing one between validation and use could otherwise steer reads out of
// bounds.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "kernels.hpp"
#include "remap.hpp"

namespace py = pybind11;

namespace {

using Int32Array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

std::string shape_of(const py::array& array) {
    return py::str(py::tuple(array.attr("shape"))).cast<std::string>();
}

// `obj` as a C-contiguous int32 array of `ndim` dimensions, without a copy
// when it already is one. Other integer dtypes are converted if every value
// fits; floats, bools and the like raise TypeError instead of being cast.
Int32Array int32_array(py::handle obj, const std::string& name, py::ssize_t ndim) {
    const py::array array = py::array::ensure(obj);
    if (!array) {
        throw py::type_error(name + " must be an integer array, got " + Py_TYPE(obj.ptr())->tp_name);
    }
    const char kind = array.dtype().kind();
    // An empty list has no dtype to honour: numpy makes it float64.
    if (kind != 'i' && kind != 'u' && array.size() > 0) {
        throw py::type_error(name + " must have an integer dtype (int32), got " +
                             py::str(array.dtype()).cast<std::string>());
    }
    if (array.ndim() != ndim) {
        throw py::value_error(name + " must be " + std::to_string(ndim) + "-D, got shape " +
                              shape_of(array));
    }
    if (!array.dtype().is(py::dtype::of<int32_t>()) && array.size() > 0) {
        const py::int_ lowest(std::numeric_limits<int32_t>::min());
        const py::int_ highest(std::numeric_limits<int32_t>::max());
        for (const char* extreme : {"argmin", "argmax"}) {
            const auto index = array.attr(extreme)().cast<py::ssize_t>();  // a flat index
            const py::object value = array.attr("item")(index);           // exact Python int
            if (value < lowest || value > highest) {
                throw py::value_error(name + (ndim == 1 ? "[" : ".flat[") + std::to_string(index) +
                                      "]=" + py::str(value).cast<std::string>() +
                                      " does not fit in int32");
            }
        }
    }
    return Int32Array::ensure(array);
}

cosa::Span<const int32_t> span_of(const Int32Array& array) { return {array.data(), array.size()}; }

// A numpy array that takes over `values` without copying them.
template <class T>
py::array_t<T> to_numpy(std::vector<T>&& values, std::vector<py::ssize_t> shape) {
    auto owned = std::make_unique<std::vector<T>>(std::move(values));
    const py::capsule base(owned.get(), [](void* p) { delete static_cast<std::vector<T>*>(p); });
    const T* data = owned.release()->data();
    return py::array_t<T>(std::move(shape), data, base);
}

py::dict build_plan(py::handle qo_indptr, py::handle kv_indptr, py::handle kv_indices,
                    py::handle kv_last_page_len, int64_t num_pages, int64_t page_size,
                    int64_t num_qo_heads, int64_t num_kv_heads, int64_t head_dim, bool causal,
                    double budget, bool force_local, bool force_sink) {
    const Int32Array qo = int32_array(qo_indptr, "qo_indptr", 1);
    const Int32Array kv = int32_array(kv_indptr, "kv_indptr", 1);
    const Int32Array indices = int32_array(kv_indices, "kv_indices", 1);
    const Int32Array last = int32_array(kv_last_page_len, "kv_last_page_len", 1);
    cosa::PlanArgs args;
    args.qo_indptr = span_of(qo);
    args.kv_indptr = span_of(kv);
    args.kv_indices = span_of(indices);
    args.kv_last_page_len = span_of(last);
    args.num_pages = num_pages;
    args.page_size = page_size;
    args.num_qo_heads = num_qo_heads;
    args.num_kv_heads = num_kv_heads;
    args.head_dim = head_dim;
    args.causal = causal;
    args.budget = budget;
    args.force_local = force_local;
    args.force_sink = force_sink;
    cosa::Plan plan = cosa::build_plan(args);

    // the sizes first: the tables move out of the plan below
    const py::ssize_t batch = plan.batch_size();
    const py::ssize_t num_kv_blocks = plan.num_kv_blocks();
    const py::ssize_t num_qtiles = plan.num_qtiles();
    const py::ssize_t num_tiles = plan.num_tiles();
    const int64_t max_request_blocks = plan.max_request_blocks();
    py::dict tables;
    tables["qo_lens"] = to_numpy(std::move(plan.qo_lens), {batch});
    tables["kv_lens"] = to_numpy(std::move(plan.kv_lens), {batch});
    tables["kv_block_indptr"] = to_numpy(std::move(plan.kv_block_indptr), {batch + 1});
    tables["block_pages"] =
        to_numpy(std::move(plan.block_pages), {num_kv_blocks, plan.pages_per_block});
    tables["qtiles"] = to_numpy(std::move(plan.qtiles), {num_qtiles, COSA_QT_COLUMNS});
    tables["tile_order"] = to_numpy(std::move(plan.tile_order), {num_tiles, 2});
    tables["k_max"] = plan.k_max;
    tables["max_request_blocks"] = max_request_blocks;
    tables["pages_per_block"] = plan.pages_per_block;
    tables["num_qo_heads"] = plan.num_qo_heads;
    return tables;
}

// A field of build_plan's dict, or the attribute of that name of another object.
py::object field(py::handle plan, const char* name) {
    if (py::isinstance<py::dict>(plan)) return py::reinterpret_borrow<py::dict>(plan)[name];
    return plan.attr(name);
}

int32_t int32_field(py::handle plan, const char* name) {
    try {
        return field(plan, name).cast<int32_t>();
    } catch (const py::cast_error&) {
        throw py::type_error(std::string("plan.") + name + " must be an int32 integer");
    }
}

// The fields resolve_order reads; cosa::resolve_order checks their consistency.
cosa::Plan plan_from_python(py::handle obj) {
    const Int32Array qtiles = int32_array(field(obj, "qtiles"), "plan.qtiles", 2);
    const Int32Array block_pages = int32_array(field(obj, "block_pages"), "plan.block_pages", 2);
    const Int32Array kv_block_indptr =
        int32_array(field(obj, "kv_block_indptr"), "plan.kv_block_indptr", 1);
    constexpr py::ssize_t kMaxPagesPerBlock = COSA_BLOCK_SIZE / cosa::kPageSizes.front();
    if (qtiles.shape(1) != COSA_QT_COLUMNS || block_pages.shape(1) < 1 ||
        block_pages.shape(1) > kMaxPagesPerBlock) {
        throw py::value_error("plan: qtiles must have " + std::to_string(COSA_QT_COLUMNS) +
                              " columns and block_pages 1.." + std::to_string(kMaxPagesPerBlock) +
                              ", got shapes " + shape_of(qtiles) + " and " + shape_of(block_pages));
    }
    cosa::Plan plan;
    plan.num_qo_heads = int32_field(obj, "num_qo_heads");
    plan.k_max = int32_field(obj, "k_max");
    plan.pages_per_block = static_cast<int32_t>(block_pages.shape(1));
    plan.qtiles.assign(qtiles.data(), qtiles.data() + qtiles.size());
    plan.block_pages.assign(block_pages.data(), block_pages.data() + block_pages.size());
    plan.kv_block_indptr.assign(kv_block_indptr.data(),
                                kv_block_indptr.data() + kv_block_indptr.size());
    return plan;
}

py::array_t<int32_t> resolve_order(py::handle plan_obj, py::handle order_obj) {
    const cosa::Plan plan = plan_from_python(plan_obj);
    const Int32Array order = int32_array(order_obj, "order", 3);
    const std::vector<py::ssize_t> expected = {plan.num_qtiles(), plan.num_qo_heads, plan.k_max};
    if (!std::equal(expected.begin(), expected.end(), order.shape())) {
        throw py::value_error("order must have shape (num_qtiles, num_qo_heads, k_max) = " +
                              py::str(py::tuple(py::cast(expected))).cast<std::string>() +
                              ", got " + shape_of(order));
    }
    py::array_t<int32_t> pages({plan.num_qtiles(), int64_t{plan.num_qo_heads},
                                int64_t{plan.k_max}, int64_t{plan.pages_per_block}});
    cosa::resolve_order(plan, span_of(order), {pages.mutable_data(), pages.size()});
    return pages;
}

// Kernel tensors as cute_kernels/aot.py passes them: per tensor its address, four extents
// and three strides (all but the last dim's), unused ones 0.
constexpr std::size_t kTensorWords = 8;

template <std::size_t N>
std::array<cosa::kernels::Tensor, N> kernel_tensors(const std::vector<int64_t>& words) {
    if (words.size() != N * kTensorWords) {
        throw py::value_error("tensors must hold " + std::to_string(N * kTensorWords) + " words (" +
                              std::to_string(N) + " tensors), got " + std::to_string(words.size()));
    }
    std::array<cosa::kernels::Tensor, N> tensors{};
    for (std::size_t i = 0; i < N; ++i) {
        const int64_t* w = words.data() + i * kTensorWords;
        tensors[i].data = reinterpret_cast<void*>(static_cast<std::uintptr_t>(w[0]));
        for (std::size_t j = 0; j < 4; ++j) {
            if (w[1 + j] < 0 || w[1 + j] > std::numeric_limits<int32_t>::max()) {
                throw py::value_error("tensor " + std::to_string(i) + " has extent " + std::to_string(w[1 + j]) +
                                      ", outside int32");
            }
            tensors[i].shape[j] = static_cast<int32_t>(w[1 + j]);
        }
        std::copy(w + 5, w + kTensorWords, tensors[i].stride);
    }
    return tensors;
}

cosa_dtype kernel_dtype(const std::string& name) {
    if (name == "bfloat16") return COSA_DTYPE_BFLOAT16;
    if (name == "float16") return COSA_DTYPE_FLOAT16;
    throw py::value_error("dtype must be 'bfloat16' or 'float16', got '" + name + "'");
}

void* stream_of(std::uintptr_t stream) { return reinterpret_cast<void*>(stream); }

void launch_osk(const std::string& dtype, int32_t head_dim, const std::vector<int64_t>& words, float sm_scale,
                float log_delta, int32_t page_shift, int32_t group, int32_t causal, int32_t num_tiles,
                std::uintptr_t stream) {
    const auto t = kernel_tensors<14>(words);
    const cosa::kernels::OskArgs args{t[0], t[1], t[2],  t[3],  t[4],     t[5],      t[6],       t[7],
                                      t[8], t[9], t[10], t[11], t[12],    t[13],     sm_scale,   log_delta,
                                      page_shift, group, causal, num_tiles};
    cosa::kernels::launch(kernel_dtype(dtype), head_dim, args, stream_of(stream));
}

void launch_kap_pool(const std::string& dtype, int32_t head_dim, const std::vector<int64_t>& words,
                     int32_t page_shift, std::uintptr_t stream) {
    const auto t = kernel_tensors<5>(words);
    cosa::kernels::launch(kernel_dtype(dtype), head_dim, cosa::kernels::PoolArgs{t[0], t[1], t[2], t[3], t[4], page_shift},
                          stream_of(stream));
}

void launch_kap_rank(const std::string& dtype, int32_t head_dim, const std::vector<int64_t>& words,
                     int32_t max_request_blocks, int32_t force_local, int32_t force_sink, std::uintptr_t stream) {
    const auto t = kernel_tensors<6>(words);
    cosa::kernels::launch(kernel_dtype(dtype), head_dim,
                          cosa::kernels::RankArgs{t[0], t[1], t[2], t[3], t[4], t[5], max_request_blocks,
                                                  force_local, force_sink},
                          stream_of(stream));
}

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "cosa's remap layer: page-table checks, block table, tile schedule (docs/design.md).";

    m.attr("BLOCK_SIZE") = int{COSA_BLOCK_SIZE};
    m.attr("MAX_SM_SCALE") = double{COSA_MAX_SM_SCALE};
    m.attr("PAGE_SIZES") = py::tuple(py::cast(cosa::kPageSizes));
    m.attr("QT_REQUEST") = int{COSA_QT_REQUEST};
    m.attr("QT_INDEX") = int{COSA_QT_INDEX};
    m.attr("QT_ROW_START") = int{COSA_QT_ROW_START};
    m.attr("QT_ROWS") = int{COSA_QT_ROWS};
    m.attr("QT_NUM_CANDIDATES") = int{COSA_QT_NUM_CANDIDATES};
    m.attr("QT_LOCAL_FIRST") = int{COSA_QT_LOCAL_FIRST};
    m.attr("QT_LOCAL_LAST") = int{COSA_QT_LOCAL_LAST};
    m.attr("QT_NUM_SELECTED") = int{COSA_QT_NUM_SELECTED};
    m.attr("QT_COLUMNS") = int{COSA_QT_COLUMNS};

    m.def("build_plan", &build_plan, py::arg("qo_indptr"), py::arg("kv_indptr"),
          py::arg("kv_indices"), py::arg("kv_last_page_len"), py::kw_only(), py::arg("num_pages"),
          py::arg("page_size"), py::arg("num_qo_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
          py::arg("causal"), py::arg("budget"), py::arg("force_local"), py::arg("force_sink"),
          R"doc(Validate a paged-KV batch and build its plan tables (docs/design.md, "Plan tensors").

The four arrays are 1-D integer arrays (int32 is used without a copy). Returns a
dict of int32 numpy arrays qo_lens [B], kv_lens [B], kv_block_indptr [B+1],
block_pages [num_kv_blocks, pages_per_block], qtiles [num_qtiles, QT_COLUMNS] and
tile_order [num_qtiles * num_qo_heads, 2], and the ints k_max, max_request_blocks (key
blocks of the longest request), pages_per_block and num_qo_heads. Raises ValueError
naming the offending argument, TypeError for a non-integer array.)doc");
    m.def("resolve_order", &resolve_order, py::arg("plan"), py::arg("order"),
          R"doc(Physical pages of an order mask: [num_qtiles, num_qo_heads, k_max, pages_per_block].

plan is build_plan's dict, or an object with its qtiles, block_pages,
kv_block_indptr, k_max and num_qo_heads as attributes (CPU arrays or tensors).
order [num_qtiles, num_qo_heads, k_max] lists each row's selected candidate
blocks, each at most once, then -1. Padding entries resolve to -1, as do slots
past kv_len. Raises ValueError naming plan or order when they disagree.)doc");

    // libcosa's exported kernels, launched as cosa_run launches them: unchecked (the
    // Python launchers check first), on the current device's stream given by address.
    m.attr("LIBCOSA") = COSA_LIBRARY_FILE;  // the file name of the libcosa this module loads, from lib/
    m.def("has_kernels", &cosa_has_kernels, "Whether libcosa was built with the kernels (COSA_AOT_KERNELS).");
    m.def("launch_osk", &launch_osk, py::arg("dtype"), py::arg("head_dim"), py::arg("tensors"),
          py::arg("sm_scale"), py::arg("log_delta"), py::arg("page_shift"), py::arg("group"),
          py::arg("causal"), py::arg("num_tiles"), py::arg("stream"));
    m.def("launch_kap_pool", &launch_kap_pool, py::arg("dtype"), py::arg("head_dim"), py::arg("tensors"),
          py::arg("page_shift"), py::arg("stream"));
    m.def("launch_kap_rank", &launch_kap_rank, py::arg("dtype"), py::arg("head_dim"), py::arg("tensors"),
          py::arg("max_request_blocks"), py::arg("force_local"), py::arg("force_sink"), py::arg("stream"));
}
