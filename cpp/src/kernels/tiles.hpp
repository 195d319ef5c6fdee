#pragma once
// Query and key tiles of the attention kernels (forward and backward): how n rows are cut.

#include "attnlab/common.hpp"

namespace attnlab::ATTNLAB_ISA_NS {  // per instruction set: see common.hpp
namespace detail {

// Tiles of `size` over n rows, a last one shorter than size / join joining the one before (n =
// 197 in tiles of 96: 96 and 101, not 96, 96 and 5, whose lanes, padded to a packet, were mostly
// padding, work for nothing: docs/performance.md). No result depends on the thread count. The
// query tiles change no bit of a row's result (dK and dV add one chain per 256 query rows of a
// head, counted from its first; P V and dQ one per key tile, the forward's key tiles at whole
// multiples of their size, the first cut where the keys a query tile sees start) but on the
// dense path (attention weights returned), whose Eigen products may round a tile's last rows
// otherwise; the backward's dQ also depends on its key segments, whose bounds are whole tiles.
inline Index tile_count(Index n, Index size, Index join = 4) {
    if (n <= 0) return 0;
    return n / size + (n < size || n % size >= size / join ? 1 : 0);
}
// Rows in tile t of tile_count(n, size) = count.
inline Index tile_rows(Index n, Index size, Index count, Index t) {
    return t + 1 == count ? n - t * size : size;
}

}  // namespace detail
}  // namespace attnlab::ATTNLAB_ISA_NS
