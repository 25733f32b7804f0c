// C++ index builders of the GPT data pipeline (pybind11 module megatron.data.helpers_cpp).
//
// build_sample_idx:       where each packed training sample starts, as (position in doc_idx, token offset).
// build_blending_indices: which dataset (and which of its samples) each blended sample comes from.
// megatron/data/helpers.py holds numpy versions that give identical arrays; tests compare the two.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

// Sample i covers tokens [i * seq_length, (i + 1) * seq_length] (inclusive: seq_length + 1 tokens, so
// consecutive samples share one token) of the documents concatenated in doc_idx order.
// Row i of the result is the (doc_idx position, offset) of token i * seq_length; rows 0..num_samples.
py::array_t<int64_t> build_sample_idx(const py::array_t<int32_t, py::array::c_style | py::array::forcecast>& sizes_,
                                      const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& doc_idx_,
                                      int64_t seq_length, int64_t num_samples) {
  if (seq_length <= 0) throw std::invalid_argument("seq_length must be positive, got " + std::to_string(seq_length));
  if (num_samples < 0) throw std::invalid_argument("num_samples must be >= 0");
  auto sizes = sizes_.unchecked<1>();
  auto doc_idx = doc_idx_.unchecked<1>();
  const int64_t num_docs = doc_idx.shape(0);
  const int64_t num_sizes = sizes.shape(0);

  py::array_t<int64_t> result({num_samples + 1, static_cast<int64_t>(2)});
  auto out = result.mutable_unchecked<2>();
  {
    py::gil_scoped_release release;
    int64_t doc_idx_index = 0;
    int64_t doc_offset = 0;
    out(0, 0) = 0;
    out(0, 1) = 0;
    for (int64_t sample = 1; sample <= num_samples; ++sample) {
      int64_t remaining = seq_length + 1;
      while (remaining != 0) {
        if (doc_idx_index >= num_docs) throw std::out_of_range("documents run out before sample " + std::to_string(sample));
        const int64_t doc_id = doc_idx(doc_idx_index);
        if (doc_id < 0 || doc_id >= num_sizes) throw std::out_of_range("doc_idx holds an id outside sizes");
        const int64_t doc_length = static_cast<int64_t>(sizes(doc_id)) - doc_offset;
        remaining -= doc_length;
        if (remaining <= 0) {
          // The sample's last token lies in this document; the next sample starts on that token.
          doc_offset += remaining + doc_length - 1;
          remaining = 0;
        } else {
          ++doc_idx_index;
          doc_offset = 0;
        }
      }
      out(sample, 0) = doc_idx_index;
      out(sample, 1) = doc_offset;
    }
  }
  return result;
}

// Greedy blending: sample i goes to the dataset whose count lags its weight the most,
// error_d = w_d * (i + 1) - count_d (first maximum wins). Returns (dataset_index uint8, sample_index int64).
py::tuple build_blending_indices(const py::array_t<double, py::array::c_style | py::array::forcecast>& weights_,
                                 int64_t size) {
  auto weights = weights_.unchecked<1>();
  const int64_t num_datasets = weights.shape(0);
  if (num_datasets < 1 || num_datasets > 255) throw std::invalid_argument("need 1 to 255 datasets to blend");
  if (size < 0) throw std::invalid_argument("size must be >= 0");
  py::array_t<uint8_t> dataset_index(size);
  py::array_t<int64_t> dataset_sample_index(size);
  auto index = dataset_index.mutable_unchecked<1>();
  auto sample_index = dataset_sample_index.mutable_unchecked<1>();
  {
    py::gil_scoped_release release;
    std::vector<int64_t> current(num_datasets, 0);
    for (int64_t i = 0; i < size; ++i) {
      const double position = static_cast<double>(i + 1);
      int64_t best = 0;
      double best_error = weights(0) * position - static_cast<double>(current[0]);
      for (int64_t d = 1; d < num_datasets; ++d) {
        const double error = weights(d) * position - static_cast<double>(current[d]);
        if (error > best_error) {
          best_error = error;
          best = d;
        }
      }
      index(i) = static_cast<uint8_t>(best);
      sample_index(i) = current[best];
      ++current[best];
    }
  }
  return py::make_tuple(dataset_index, dataset_sample_index);
}

PYBIND11_MODULE(helpers_cpp, m) {
  m.doc() = "C++ index builders for megatron.data (sample index, blending index)";
  m.def("build_sample_idx", &build_sample_idx, py::arg("sizes"), py::arg("doc_idx"), py::arg("seq_length"),
        py::arg("num_samples"));
  m.def("build_blending_indices", &build_blending_indices, py::arg("weights"), py::arg("size"));
}
