// The sparse codec's kernels in CUDA: the same box tables, tiles, bitmap words and payload
// positions as their Triton versions (`sparse_triton.py`). `diff`, `compact` (busy rows) and
// `compact_sparse` (the others), and the busy `expand`, for launches whose boxes are all on the
// vectorized path (contiguous, 16-byte aligned); `starts`, the receiver's checks of every row
// (Triton's `bitmap_counts` then `scan`, in one launch), and `blocked_check` and `blocked_apply`
// for blocked rows, strided or not. A launch of Triton's costs the host tens of microseconds more,
// on the round's critical path.
// `sparse_cuda.py` compiles this file with NVRTC (through CuPy) and passes the table columns,
// `BLOCK`, `STAGE_SHARE` and the `STAGE_RUN_<width>`s as -D macros, so Python stays their one
// definition.
//
// Unlike Triton's, the CUDA `diff` also advances the baseline of the rows that ask (SEND_UPDATE)
// and leaves the values of each warp's run with few changes (at most `1 / STAGE_SHARE` of it) in a
// stage beside the bitmap words, in order: the sender's `compact` then reads those runs' values from
// there rather than the whole source again, and writes no baseline.
//
// `compact` and `expand` work a warp at a time on 16 bytes a lane: each lane reads (or
// read-merge-writes) 16 bytes and takes its marks from the bitmap word they fall in; a warp-wide
// shuffle scan gives the marks' payload positions, and the values pass through shared memory so
// that the payload is read and written in consecutive runs rather than scattered 1- to 8-byte
// accesses. Loads that do not depend on each other are issued together (`compact` reads a step
// ahead, `expand` stages 4 values a lane at once): a warp waiting on one load at a time left the
// kernels short of memory bandwidth.

typedef long long i64;
typedef unsigned int u32;

#define FULL_MASK 0xffffffffu

namespace {

template <typename VT>
union Lane {
  uint4 vec;
  VT el[16 / sizeof(VT)];
};

// A launch's program starts (`boxes + 1`) then its rows, passed in the kernel's parameters rather
// than uploaded: every kernel but `diff` reads them from here when its `table` is null.
// `__grid_constant__` keeps them in the parameter space, read through their address, not copied
// to each thread.
struct Inline {
  i64 v[INLINE_VALUES];
};

// Where a launch's rows and program starts are: `*table` and `*firsts` in global memory, or,
// `*table` being null, inline in `in`.
__device__ __forceinline__ void rows_of(const Inline& in, i64 boxes, const i64** table, const i64** firsts) {
  if (*table == nullptr) {
    *firsts = in.v;
    *table = in.v + boxes + 1;
  }
}

// This program's box (the last whose first program is at most this one) and its tile within it.
__device__ __forceinline__ i64 find_box(const i64* firsts, i64 boxes, i64* tile) {
  const i64 pid = blockIdx.x;
  i64 lo = 0, hi = boxes;
  while (hi - lo > 1) {
    const i64 mid = (lo + hi) / 2;
    if (firsts[mid] <= pid) lo = mid;
    else hi = mid;
  }
  *tile = pid - firsts[lo];
  return lo;
}

// Whether this program is past the launch's last (a launch `place` sized on the device, queued with
// an upper bound of programs: those past `firsts[boxes]` return at once).
__device__ __forceinline__ bool past_last(const i64* firsts, i64 boxes) { return blockIdx.x >= firsts[boxes]; }

// Word `i` of a tile with `left` of its elements in the box, bits at or past `left` cleared
// (words wholly past it are not read); `WHOLE`: the tile is whole, every word is read as it is.
template <bool WHOLE = false>
__device__ __forceinline__ u32 word_below(const u32* words, int i, int left) {
  if (WHOLE) return words[i];
  const int rest = left - i * 32;
  if (rest <= 0) return 0;
  const u32 w = words[i];
  return rest >= 32 ? w : w & ((1u << rest) - 1u);
}

__device__ __forceinline__ int warp_sum(int x) {
  for (int o = 16; o; o >>= 1) x += __shfl_xor_sync(FULL_MASK, x, o);
  return x;
}

template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T x, int lane) {
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(FULL_MASK, x, o);
    if (lane >= o) x += y;
  }
  return x;
}

// The marks of a program's threads before this one's, each thread's being those of its 2 words
// (`low`, `high`), a program being `WARPS` warps: a warp-wide scan, then the warps before this one
// (`counts`, a value a warp); and, through the same barrier, whether `ok` holds on every thread of
// the program (`*all`, where given). Every thread of the program calls it.
template <int WARPS>
__device__ __forceinline__ int marks_ahead(u32 low, u32 high, int* counts, bool ok = true, bool* all = nullptr) {
  constexpr int NOT_OK = 1 << 30;  // (above any count: a warp's threads have at most 64 * 32 marks)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int own = __popc(low) + __popc(high), through = warp_inclusive_scan(own, lane);
  const bool not_ok = __any_sync(FULL_MASK, !ok);
  if (lane == 31) counts[warp] = through | (not_ok ? NOT_OK : 0);
  __syncthreads();
  int ahead = through - own, seen = 0;
#pragma unroll
  for (int i = 0; i < WARPS; i++) {
    seen |= counts[i];
    if (i < warp) ahead += counts[i] & (NOT_OK - 1);
  }
  if (all) *all = !(seen & NOT_OK);
  return ahead;
}

// Elements of a warp's run in `diff` for elements of `VT` (`sparse_cuda.stage_run`): the unit of the stage.
template <typename VT>
__device__ constexpr int stage_run() {
  return sizeof(VT) == 1   ? STAGE_RUN_1
         : sizeof(VT) == 2 ? STAGE_RUN_2
         : sizeof(VT) == 4 ? STAGE_RUN_4
                           : STAGE_RUN_8;
}

// The marks of the tile's first `warp` warps (each `span` elements) before this warp's own:
// every warp counts its words, then adds up the counts of the warps before it.
template <int WARPS>
__device__ __forceinline__ int marks_before(const u32* words, int span, int left, int* counts) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int c = 0;
  for (int i = lane; i < span / 32; i += 32) c += __popc(word_below(words, warp * (span / 32) + i, left));
  c = warp_sum(c);
  if (lane == 0) counts[warp] = c;
  __syncthreads();
  int before = 0;
  for (int i = 0; i < warp; i++) before += counts[i];
  return before;
}

}  // namespace

// For each SEND row (`TILE / PART` programs a tile, `PART` elements each, a run of `PART / WARPS`
// a warp): the part's bitmap words at the row's tile slot (bits at or past `n` zero), its changes
// added to its tile's count and to the box's total (its SEND_COUNT). Elements compare as bits, so
// NaN payloads and -0.0 count as changes. Every load of a thread is issued before its first
// comparison. The row's baseline takes the source's 16 bytes a lane wherever they differ
// (SEND_UPDATE: no other box reads it), and a warp whose run has at most `1 / STAGE_SHARE` of it
// changed leaves their values in order at the run's place in the row's stage (SEND_STAGE: bytes
// from `words`), so that `compact` need not read the source again. A warp stages on its own (a
// warp-wide scan, shared memory, then 16-byte stores): the one block-wide step is the count.
template <typename VT, int TILE, int PART, int WARPS>
__global__ void __launch_bounds__(WARPS * 32)
    diff(const i64* table, const i64* firsts, i64 boxes, u32* words, unsigned long long* counts,
         unsigned long long* totals, VT* anchor) {
  constexpr int EPL = 16 / sizeof(VT), ITER = PART / EPL / (WARPS * 32), PER_WORD = 32 / EPL;
  constexpr int RUN = PART / WARPS, CAP = RUN / STAGE_SHARE;  // a warp's elements; values it stages
  static_assert(ITER * WARPS * 32 * EPL == PART, "a part is whole 16-byte lanes of every thread");
  static_assert(RUN == stage_run<VT>(), "the run `compact` finds a stage by");
  __shared__ int warp_counts[WARPS];
  __shared__ __align__(16) VT staged[WARPS][CAP];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  i64 p;
  const i64* row = table + find_box(firsts, boxes, &p) * SEND_COLUMNS;
  const i64 n = row[SEND_N], start = p * PART;
  const int left = (int)(n - start < PART ? n - start : PART);  // (at most 0 past the box's end)
  const VT* cur = anchor + row[SEND_CUR] + start;
  VT* base = anchor + row[SEND_BASE] + start;
  Lane<VT> c[ITER], b[ITER];
#pragma unroll
  for (int i = 0; i < ITER; i++) {
    const int le = warp * RUN + (i * 32 + lane) * EPL;
    if (left == PART) {
      c[i].vec = *reinterpret_cast<const uint4*>(cur + le);
      b[i].vec = *reinterpret_cast<const uint4*>(base + le);
    } else {
#pragma unroll
      for (int j = 0; j < EPL; j++) {
        c[i].el[j] = le + j < left ? cur[le + j] : VT(0);
        b[i].el[j] = le + j < left ? base[le + j] : VT(0);
      }
    }
  }
  u32* out = words + row[SEND_SLOT] * (TILE / 32) + p * (PART / 32);
  const bool update = row[SEND_UPDATE] != 0;
  int fill = 0;  // the warp's changes so far, in element order
#pragma unroll
  for (int i = 0; i < ITER; i++) {
    const int v = warp * (RUN / EPL) + i * 32 + lane;  // this lane's 16 bytes in the part
    u32 bits = 0;
#pragma unroll
    for (int j = 0; j < EPL; j++) bits |= (u32)(c[i].el[j] != b[i].el[j]) << j;
    u32 word = bits << ((v % PER_WORD) * EPL);
    for (int o = 1; o < PER_WORD; o <<= 1) word |= __shfl_xor_sync(FULL_MASK, word, o);
    if (v % PER_WORD == 0) out[v / PER_WORD] = word;
    if (update && bits) {
      if (left == PART) {
        *reinterpret_cast<uint4*>(base + v * EPL) = c[i].vec;
      } else {
#pragma unroll
        for (int j = 0; j < EPL; j++)
          if ((bits >> j) & 1u) base[v * EPL + j] = c[i].el[j];
      }
    }
    const int own = __popc(bits), through = warp_inclusive_scan(own, lane);
    int at = fill + through - own;
#pragma unroll
    for (int j = 0; j < EPL; j++)
      if ((bits >> j) & 1u) {
        if (at < CAP) staged[warp][at] = c[i].el[j];
        at++;
      }
    fill += __shfl_sync(FULL_MASK, through, 31);
  }
  if (fill <= CAP) {  // (else `compact` reads this run's values from the source)
    __syncwarp();
    uint4* stage = reinterpret_cast<uint4*>(reinterpret_cast<char*>(words) + row[SEND_STAGE]);
    stage += (start / RUN + warp) * (CAP * sizeof(VT) / 16);
    const uint4* runs = reinterpret_cast<const uint4*>(staged[warp]);
    for (int r = lane; r * 16 < fill * (int)sizeof(VT); r += 32) stage[r] = runs[r];
  }
  if (lane == 0) warp_counts[warp] = fill;
  __syncthreads();
  if (threadIdx.x != 0) return;
  int total = 0;
  for (int w = 0; w < WARPS; w++) total += warp_counts[w];
  if (total) {
    atomicAdd(counts + row[SEND_SLOT] + p / (TILE / PART), (unsigned long long)total);
    atomicAdd(totals + row[SEND_COUNT], (unsigned long long)total);
  }
}

// Staged value `s` (and its index or in-block offset, as `KIND` says) to payload position `p`.
template <typename VT, int KIND>
__device__ __forceinline__ void put(VT* values, void* index, i64 p, const VT* staged, const int* staged_at, int s) {
  values[p] = staged[s];
  if (KIND == INT32_INDEX) reinterpret_cast<int*>(index)[p] = staged_at[s];
  if (KIND == UINT16_OFFSET) reinterpret_cast<short*>(index)[p] = (short)staged_at[s];
}

// The marked elements of a lane (`mine`, `EPL` bits) into `out`, from staged value `at` on (payload
// position `pos + at`); positions at or past `k` are not read.
template <typename VT, int EPL>
__device__ __forceinline__ void merge(VT* out, u32 mine, int at, i64 pos, i64 k, const VT* staged) {
#pragma unroll
  for (int j = 0; j < EPL; j++) {
    if ((mine >> j) & 1u) {
      if (pos + at < k) out[j] = staged[at];
      at++;
    }
  }
}

// One tile of a SEND row from its payload position `pos` on. Template arguments, so that each loop
// carries only its own work: `KIND`, the row's index kind (-1: the baseline only, no values), and
// `WHOLE`, the tile is whole (a fixed trip count, unrolled, so that the next steps' loads are in
// flight while a step's marks are staged).
template <typename VT, int TILE, int WARPS, int KIND, bool WHOLE>
__device__ __forceinline__ void compact_tile(const i64* row, VT* anchor, const u32* w, i64 start, int left, i64 pos,
                                             VT* staged, int* staged_at) {
  constexpr int EPL = 16 / sizeof(VT), STEP = 32 * EPL, SPAN = TILE / WARPS;
  static_assert(SPAN % STEP == 0, "a warp's share of a tile is whole steps");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool update = row[SEND_UPDATE] != 0;
  const VT* cur = anchor + row[SEND_CUR] + start;
  VT* base = anchor + row[SEND_BASE] + start;
  VT* values = anchor + row[SEND_VALUES];
  void* index = reinterpret_cast<void*>(row[SEND_INDEX]);
  int fill = 0;
  uint4 ahead = WHOLE ? *reinterpret_cast<const uint4*>(cur + warp * SPAN + lane * EPL) : make_uint4(0, 0, 0, 0);
#pragma unroll 8
  for (int s = 0; s < SPAN / STEP; s++) {
    const int e = warp * SPAN + s * STEP;
    if (!WHOLE && e >= left) break;
    const int le = e + lane * EPL;  // this lane's first element in the tile
    const u32 mine = (word_below<WHOLE>(w, le / 32, left) >> (le % 32)) & ((1u << EPL) - 1u);
    Lane<VT> x;
    if (WHOLE) {  // the next step's run is read before this one's marks are staged (one load in flight ahead)
      const uint4 run = ahead;
      if (s + 1 < SPAN / STEP) ahead = *reinterpret_cast<const uint4*>(cur + le + STEP);
      if (update) *reinterpret_cast<uint4*>(base + le) = run;
      x.vec = run;
    } else if (le + EPL <= left) {  // (lanes without marks too: partial writes cost more than whole ones)
      const uint4 run = *reinterpret_cast<const uint4*>(cur + le);  // (stored from `run`: one 16-byte store)
      if (update) *reinterpret_cast<uint4*>(base + le) = run;
      x.vec = run;
    } else if (mine) {
#pragma unroll
      for (int j = 0; j < EPL; j++) {  // (unrolled, so that `x` stays in registers)
        if ((mine >> j) & 1u) {
          x.el[j] = cur[le + j];
          if (update) base[le + j] = x.el[j];
        }
      }
    }
    if (KIND < 0) continue;
    const int own = __popc(mine), through = warp_inclusive_scan(own, lane);
    int at = fill + through - own;
#pragma unroll
    for (int j = 0; j < EPL; j++) {
      if ((mine >> j) & 1u) {
        staged[at] = x.el[j];
        if (KIND == INT32_INDEX) staged_at[at] = (int)(start + le + j);
        if (KIND == UINT16_OFFSET) staged_at[at] = (int)((start % BLOCK + le + j) & 0xffff);
        at++;
      }
    }
    fill += __shfl_sync(FULL_MASK, through, 31);
    __syncwarp();
    const int whole = fill >> 5, rest = fill & 31;
    for (int g = 0; g < whole; g++) put<VT, KIND>(values, index, pos + g * 32 + lane, staged, staged_at, g * 32 + lane);
    pos += whole * 32;
    const VT keep = lane < rest ? staged[whole * 32 + lane] : VT(0);
    const int keep_at = KIND > 0 && lane < rest ? staged_at[whole * 32 + lane] : 0;
    __syncwarp();
    if (lane < rest) {
      staged[lane] = keep;
      if (KIND > 0) staged_at[lane] = keep_at;
    }
    __syncwarp();
    fill = rest;
  }
  if (KIND >= 0 && lane < fill) put<VT, KIND>(values, index, pos + lane, staged, staged_at, lane);
}

// The index (int32) or in-block offset (uint16) of element `local` of the tile from element
// `start` of a SEND row, at payload position `pos`, as the row's index `kind` asks (none: nothing).
__device__ __forceinline__ void put_index(void* index, int kind, i64 pos, i64 start, i64 local) {
  if (kind == INT32_INDEX) reinterpret_cast<int*>(index)[pos] = (int)(start + local);
  if (kind == UINT16_OFFSET) reinterpret_cast<short*>(index)[pos] = (short)((start % BLOCK + local) & 0xffff);
}

// Tile `t` of a SEND row from the row's stage, if each of its runs left its values there (`diff`:
// at most `1 / STAGE_SHARE` of a run changed; false, and nothing written, if not). Every thread of
// the program calls it, with its 2 words of the tile (`low`, `high`) and the tile's first payload
// position `first`; `*pos`, where given, becomes the thread's first payload position either way.
// Each group of the threads of a run loads the run's values from the stage before the program's
// one barrier (the loads in flight while it waits), then stores them in order at the run's payload
// positions; then each thread writes its marks' indices or in-block offsets from its words. The
// source is not read, nor the baseline written (`diff` did).
template <typename VT, int TILE>
__device__ __forceinline__ bool staged_tile(const i64* row, VT* anchor, const u32* words, u32 low, u32 high, i64 t,
                                            i64 first, int* counts, i64* pos = nullptr) {
  constexpr int RUN = stage_run<VT>(), GROUP = RUN / 64, CAP = RUN / STAGE_SHARE, WARPS = TILE / 64 / 32;
  static_assert(GROUP * 64 == RUN && GROUP <= 32, "a run is the words of whole threads of a warp");
  const int lane = threadIdx.x & 31, g = lane % GROUP;
  const int kind = (int)row[SEND_INDEX_KIND];
  const bool staged = row[SEND_STAGE] >= 0;
  const i64 own = threadIdx.x * 64;  // (the thread's first element in the tile)
  VT v[CAP / GROUP];
  if (staged && kind >= NO_INDEX) {  // every slot of the run's stage, used or not: loads that need not wait
    const VT* stage = reinterpret_cast<const VT*>(reinterpret_cast<const char*>(words) + row[SEND_STAGE]);
    stage += (t * TILE + own) / RUN * CAP;  // for the marks (the words' loads and these in flight together)
#pragma unroll
    for (int r = 0; r < CAP / GROUP; r++) v[r] = stage[g + r * GROUP];
  }
  int marks = __popc(low) + __popc(high);  // the run's
  for (int o = GROUP / 2; o; o >>= 1) marks += __shfl_xor_sync(FULL_MASK, marks, o);
  const bool fits = staged && marks <= CAP;
  bool all_fit;
  i64 at = first + marks_ahead<WARPS>(low, high, counts, fits, &all_fit);
  if (pos) *pos = at;
  if (!all_fit) return false;
  const i64 head = __shfl_sync(FULL_MASK, at, lane - g);  // (the run's first position)
  VT* values = anchor + row[SEND_VALUES];
  if (kind >= NO_INDEX) {
#pragma unroll
    for (int r = 0; r < CAP / GROUP; r++)
      if (g + r * GROUP < marks) values[head + g + r * GROUP] = v[r];
  }
  if (kind != INT32_INDEX && kind != UINT16_OFFSET) return true;
  void* index = reinterpret_cast<void*>(row[SEND_INDEX]);
  const i64 start = t * TILE;
  for (unsigned long long m = (unsigned long long)high << 32 | low; m; m &= m - 1, at++)
    put_index(index, kind, at, start, own + __ffsll(m) - 1);
  return true;
}

// A thread's 2 words of tile `t` (`low`, `high`: words `first` and `first + 1`) to the wire bitmap
// of a SEND row that asks for it (SEND_BITMAP_OUT), those wholly past the box's end (`left`) left out.
template <int TILE>
__device__ __forceinline__ void put_words(const i64* row, i64 t, int first, u32 low, u32 high, int left) {
  u32* bitmap = reinterpret_cast<u32*>(row[SEND_BITMAP_OUT]);
  if (bitmap && first * 32 < left) bitmap[t * (TILE / 32) + first] = low;
  if (bitmap && (first + 1) * 32 < left) bitmap[t * (TILE / 32) + first + 1] = high;
}

// The wire block count of a SEND row that asks for them (SEND_BLOCKS_OUT), by the program of the
// block's first tile `t`.
template <int TILE>
__device__ __forceinline__ void wire_block_count(const i64* row, const int* blocks, i64 slot, i64 t) {
  int* out = reinterpret_cast<int*>(row[SEND_BLOCKS_OUT]);
  if (out && threadIdx.x == 0 && t % (BLOCK / TILE) == 0) out[t / (BLOCK / TILE)] = blocks[(slot + t) / (BLOCK / TILE)];
}

template <typename VT, int TILE, int WARPS, int KIND>
__device__ __forceinline__ void compact_kind(const i64* row, VT* anchor, const u32* w, i64 start, int left, i64 pos,
                                             VT* staged, int* staged_at) {
  if (left == TILE) compact_tile<VT, TILE, WARPS, KIND, true>(row, anchor, w, start, left, pos, staged, staged_at);
  else compact_tile<VT, TILE, WARPS, KIND, false>(row, anchor, w, start, left, pos, staged, staged_at);
}

// One program (a tile) of `compact` or `compact_staged`: the marked values of a SEND row at their
// payload positions and their indices (int32) or in-block offsets (uint16), the wire bitmap and wire
// block counts, as the row's columns ask; with `STAGED`, from the stage where each run of the tile
// left its values there and the row does not update the baseline (`staged_tile`); else from the
// source, with the baseline update where the row asks (16 bytes a lane, read and written whole:
// unmarked elements equal the source already, as `diff` found them, since nothing writes the source
// between the two launches).
template <typename VT, int TILE, int WARPS, bool STAGED>
__device__ __forceinline__ void compact_program(const Inline& in, const i64* table, const i64* firsts, i64 boxes,
                                                const u32* words, const i64* starts, const int* blocks, VT* anchor) {
  constexpr int STEP = 32 * (16 / sizeof(VT)), WPT = TILE / 32;
  rows_of(in, boxes, &table, &firsts);
  if (past_last(firsts, boxes)) return;
  __shared__ int counts[WARPS];
  __shared__ VT staged_values[WARPS][STEP + 32];
  __shared__ int staged_index[WARPS][STEP + 32];
  const int warp = threadIdx.x >> 5;
  i64 t;
  const i64* row = table + find_box(firsts, boxes, &t) * SEND_COLUMNS;
  const i64 n = row[SEND_N], slot = row[SEND_SLOT], start = t * TILE;
  const int left = (int)(n - start < TILE ? n - start : TILE);
  const u32* w = words + (slot + t) * WPT;
  const i64 first = starts[slot + t] - starts[slot];
  if (STAGED && row[SEND_UPDATE] == 0) {
    static_assert(2 * WARPS * 32 == WPT, "a tile's words are 2 a thread");
    const u32 low = word_below(w, threadIdx.x * 2, left), high = word_below(w, threadIdx.x * 2 + 1, left);
    if (staged_tile<VT, TILE>(row, anchor, words, low, high, t, first, counts)) {
      put_words<TILE>(row, t, threadIdx.x * 2, low, high, left);
      wire_block_count<TILE>(row, blocks, slot, t);
      return;
    }
    __syncthreads();  // (`counts` is read again below)
  }
  u32* bitmap = reinterpret_cast<u32*>(row[SEND_BITMAP_OUT]);
  if (bitmap)
    for (int i = threadIdx.x; i * 32 < left; i += blockDim.x) bitmap[t * WPT + i] = word_below(w, i, left);
  const i64 pos = first + marks_before<WARPS>(w, TILE / WARPS, left, counts);
  VT* staged = staged_values[warp];
  int* staged_at = staged_index[warp];
  switch ((int)row[SEND_INDEX_KIND]) {
    case NO_INDEX:
      compact_kind<VT, TILE, WARPS, NO_INDEX>(row, anchor, w, start, left, pos, staged, staged_at);
      break;
    case INT32_INDEX:
      compact_kind<VT, TILE, WARPS, INT32_INDEX>(row, anchor, w, start, left, pos, staged, staged_at);
      break;
    case UINT16_OFFSET:
      compact_kind<VT, TILE, WARPS, UINT16_OFFSET>(row, anchor, w, start, left, pos, staged, staged_at);
      break;
    default:
      compact_kind<VT, TILE, WARPS, -1>(row, anchor, w, start, left, pos, staged, staged_at);
  }
  wire_block_count<TILE>(row, blocks, slot, t);
}

// `compact_program` for busier SEND rows (more than `1 / sparse_table.BUSIER` changed: more than a
// stage holds), from the source. At least 48 warps an SM for 2-byte elements (40 registers a
// thread: with 40 warps and 48 registers it took 4% longer on an H200), 40 for 1-byte ones (48
// registers, as before the read one step ahead; 32 warps took 2% longer), 32 for wider ones (64
// registers; fewer spill).
template <typename VT, int TILE, int WARPS>
__global__ void __launch_bounds__(WARPS * 32, (sizeof(VT) == 2 ? 48 : sizeof(VT) == 1 ? 40 : 32) / WARPS)
    compact(const __grid_constant__ Inline in, const i64* table, const i64* firsts, i64 boxes, const u32* words,
            const i64* starts, const int* blocks, VT* anchor) {
  compact_program<VT, TILE, WARPS, false>(in, table, firsts, boxes, words, starts, blocks, anchor);
}

// `compact_program` for busy SEND rows (most of whose tiles' runs a stage holds), from the stage
// where it can: 40 warps an SM for 1- and 2-byte elements (48 registers: at 40 the staged path
// spills), 32 for wider ones.
template <typename VT, int TILE, int WARPS>
__global__ void __launch_bounds__(WARPS * 32, (sizeof(VT) <= 2 ? 40 : 32) / WARPS)
    compact_staged(const __grid_constant__ Inline in, const i64* table, const i64* firsts, i64 boxes,
                   const u32* words, const i64* starts, const int* blocks, VT* anchor) {
  compact_program<VT, TILE, WARPS, true>(in, table, firsts, boxes, words, starts, blocks, anchor);
}

// The marks `m` of a SEND row's 64 elements from `local` in tile `start` on, lowest first, `ROUND` at
// a time, their loads issued together: each value (and its index or in-block offset) to payload
// position `pos` on, and to the baseline with `update`.
template <typename VT, int ROUND = 4>
__device__ __forceinline__ void marks_from_source(const i64* row, VT* anchor, i64 start, int local,
                                                  unsigned long long m, i64 pos, int kind, bool update) {
  const VT* cur = anchor + row[SEND_CUR] + start + local;
  VT* base = anchor + row[SEND_BASE] + start + local;
  VT* values = anchor + row[SEND_VALUES];
  void* index = reinterpret_cast<void*>(row[SEND_INDEX]);
  while (m) {
    int at[ROUND];
    VT v[ROUND];
#pragma unroll
    for (int r = 0; r < ROUND; r++) {
      at[r] = m ? __ffsll(m) - 1 : -1;  // (this thread's element; -1: no more marks)
      m &= m - 1;
    }
#pragma unroll
    for (int r = 0; r < ROUND; r++)
      if (at[r] >= 0) v[r] = cur[at[r]];
#pragma unroll
    for (int r = 0; r < ROUND; r++) {
      if (at[r] < 0) break;
      if (update) base[at[r]] = v[r];
      if (kind >= NO_INDEX) values[pos] = v[r];
      put_index(index, kind, pos, start, local + at[r]);
      pos++;
    }
  }
}

// `compact` for sparse SEND rows (at most one change in `sparse_table.BUSY` elements: a few marks a
// word), one program a tile: each thread takes 2 consecutive words and a block-wide scan of their
// marks gives its first payload position. A tile whose runs left their values in the stage takes
// them from there (`staged_tile`); any other visits its marks in the source (`marks_from_source`):
// the busy `compact`'s outputs, element by element, only the marked elements read. Held at 40
// registers, 48 warps an SM (8-byte elements, which spill at 40, at 48 registers and 40 warps): the
// staged loads before the barrier took 48 registers, and at 40 warps it took 163 against 153 µs
// on an H200 (1 GiB of bf16 at 1%).
template <typename VT, int TILE, int WARPS>
__global__ void __launch_bounds__(WARPS * 32, (sizeof(VT) == 8 ? 40 : 48) / WARPS)
    compact_sparse(const __grid_constant__ Inline in, const i64* table, const i64* firsts, i64 boxes,
                   const u32* words, const i64* starts, const int* blocks, VT* anchor) {
  constexpr int WPT = TILE / 32;
  static_assert(2 * WARPS * 32 == WPT, "a tile's words are 2 a thread");
  rows_of(in, boxes, &table, &firsts);
  if (past_last(firsts, boxes)) return;
  __shared__ int counts[WARPS];
  i64 t;
  const i64* row = table + find_box(firsts, boxes, &t) * SEND_COLUMNS;
  const i64 n = row[SEND_N], slot = row[SEND_SLOT], start = t * TILE;
  const int left = (int)(n - start < TILE ? n - start : TILE), first = threadIdx.x * 2;
  const u32* w = words + (slot + t) * WPT;
  const u32 low = word_below(w, first, left), high = word_below(w, first + 1, left);
  const i64 tile_first = starts[slot + t] - starts[slot];
  put_words<TILE>(row, t, first, low, high, left);
  const int kind = (int)row[SEND_INDEX_KIND];
  const bool update = row[SEND_UPDATE] != 0;
  i64 pos;
  if (update) pos = tile_first + marks_ahead<WARPS>(low, high, counts);
  if (update || !staged_tile<VT, TILE>(row, anchor, words, low, high, t, tile_first, counts, &pos))
    marks_from_source<VT>(row, anchor, start, first * 32, (unsigned long long)high << 32 | low, pos, kind, update);
  wire_block_count<TILE>(row, blocks, slot, t);
}

// The first `count` of `values` into `staged`, each lane's loads (4 at a time) all issued before it
// stores the first: a lane's loads are in flight together rather than one after another.
template <typename VT>
__device__ __forceinline__ void stage(VT* staged, const VT* values, int count, int lane) {
  for (int first = 0; first < count; first += 128) {
    VT v[4];
#pragma unroll
    for (int u = 0; u < 4; u++) {
      const int j = first + 32 * u + lane;
      v[u] = j < count ? values[j] : VT(0);
    }
#pragma unroll
    for (int u = 0; u < 4; u++) {
      const int j = first + 32 * u + lane;
      if (j < count) staged[j] = v[u];
    }
  }
}

// One tile of a bitmap RECV row from its payload position `pos` on (`WHOLE`: the tile is whole).
template <typename VT, int TILE, int WARPS, bool WHOLE>
__device__ __forceinline__ void expand_tile(const i64* row, VT* anchor, const u32* w, i64 start, int left, i64 pos,
                                            VT* staged) {
  constexpr int EPL = 16 / sizeof(VT), SPAN = TILE / WARPS, CHUNK = 1024;
  static_assert(SPAN % CHUNK == 0, "a warp's share of a tile is whole chunks");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const i64 k = row[RECV_K];
  const VT* values = anchor + row[RECV_VALUES];
  VT* dest = anchor + row[RECV_DEST] + start;
  for (int c = 0; c < SPAN / CHUNK; c++) {
    const int e = warp * SPAN + c * CHUNK;
    if (!WHOLE && e >= left) break;
    const u32 word = word_below<WHOLE>(w, e / 32 + lane, left);
    const int own = __popc(word), through = warp_inclusive_scan(own, lane);
    const int before = through - own, total = __shfl_sync(FULL_MASK, through, 31);
    stage<VT>(staged, values + pos, (int)min((i64)total, max(k - pos, (i64)0)), lane);
    __syncwarp();
#pragma unroll
    for (int s = 0; s < CHUNK; s += 32 * EPL) {
      const int off = s + lane * EPL, shift = off % 32;
      const u32 wd = __shfl_sync(FULL_MASK, word, off / 32);
      int at = __shfl_sync(FULL_MASK, before, off / 32) + __popc(wd & ((1u << shift) - 1u));
      const u32 mine = (wd >> shift) & ((1u << EPL) - 1u);
      if (!mine) continue;
      VT* d = dest + e + off;
      if (WHOLE || e + off + EPL <= left) {
        Lane<VT> x;
        x.vec = *reinterpret_cast<const uint4*>(d);
        merge<VT, EPL>(x.el, mine, at, pos, k, staged);
        *reinterpret_cast<uint4*>(d) = x.vec;
      } else {
        merge<VT, EPL>(d, mine, at, pos, k, staged);  // element by element: the lane reaches past the box
      }
    }
    pos += total;
    __syncwarp();
  }
}

// For each bitmap RECV row (one program a tile), unless `guard` is raised: each warp loads the
// values of 32 words (1,024 elements) into shared memory in one run, then each lane merges its
// marked elements into its 16 bytes of the live view and writes them back whole (element by element
// where the 16 bytes reach past the box). Payload positions at or past `k` are not read.
template <typename VT, int TILE, int WARPS>
__global__ void __launch_bounds__(WARPS * 32)
    expand(const __grid_constant__ Inline in, const i64* table, const i64* firsts, i64 boxes, const i64* starts,
           const int* guard, VT* anchor) {
  if (*guard) return;  // a box of the bucket is malformed: nothing is written
  rows_of(in, boxes, &table, &firsts);
  __shared__ int counts[WARPS];
  __shared__ VT staged_values[WARPS][1024];
  i64 t;
  const i64* row = table + find_box(firsts, boxes, &t) * RECV_COLUMNS;
  const i64 n = row[RECV_N], start = t * TILE;
  const int left = (int)(n - start < TILE ? n - start : TILE);
  const u32* w = reinterpret_cast<const u32*>(row[RECV_WORDS]) + t * (TILE / 32);
  const i64 pos = starts[row[RECV_FIRST] + t] + marks_before<WARPS>(w, TILE / WARPS, left, counts);
  VT* staged = staged_values[threadIdx.x >> 5];
  if (left == TILE) expand_tile<VT, TILE, WARPS, true>(row, anchor, w, start, left, pos, staged);
  else expand_tile<VT, TILE, WARPS, false>(row, anchor, w, start, left, pos, staged);
}

namespace {

// Raise box `row`'s flag, and with it the bucket's guard, when `wrong`.
__device__ __forceinline__ void raise_flag(const i64* row, int* flags, int* guard, bool wrong) {
  if (!wrong) return;
  atomicMax(flags + row[RECV_FLAG], 1);
  atomicMax(guard, 1);
}

// Tile `t` of a bitmap RECV row, counted by one warp: its marks below `n` (every lane gets the
// sum), and whether a bit of the wire bitmap's last byte past `n` is set (`*stray`, this lane's
// share). Each lane reads 16 bytes of words at a time, every read issued before the first count; a
// run that starts below `n` ends inside the payload (its bitmap is padded to 16 bytes), and its
// words wholly past `n` count nothing.
template <int TILE>
__device__ __forceinline__ int tile_marks(const i64* row, i64 t, int* stray) {
  constexpr int RUNS = TILE / 128 / 32;  // 16-byte runs a lane
  const int lane = threadIdx.x & 31;
  const i64 n = row[RECV_N], start = t * TILE;
  const int left = (int)(n - start < TILE ? n - start : TILE), pad = (int)((n + 7) / 8 * 8 - n);
  const uint4* runs = reinterpret_cast<const uint4*>(row[RECV_WORDS]) + t * (TILE / 128);
  uint4 run[RUNS];
#pragma unroll
  for (int r = 0; r < RUNS; r++) run[r] = (r * 32 + lane) * 128 < left ? runs[r * 32 + lane] : make_uint4(0, 0, 0, 0);
  int marks = 0, odd = 0;
#pragma unroll
  for (int r = 0; r < RUNS; r++) {
    const u32 words[4] = {run[r].x, run[r].y, run[r].z, run[r].w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const int rest = left - (4 * (r * 32 + lane) + j) * 32, wire = rest + pad;
      if (rest <= 0) break;
      marks += __popc(rest >= 32 ? words[j] : words[j] & ((1u << rest) - 1u));
      if (rest < 32) odd |= (words[j] & ~((1u << rest) - 1u) & (wire >= 32 ? ~0u : (1u << wire) - 1u)) != 0;
    }
  }
  *stray = odd;
  return warp_sum(marks);
}

// `out[i]` = the exclusive prefix sums of `source[0 .. m)`, each clamped to the row's limit; the
// row's flag when a count is out of range or they do not add up to its `k`. Each thread takes
// `ITEMS` consecutive counts a pass, all loaded before any is added.
template <int WARPS, int ITEMS>
__device__ __forceinline__ void scan_row(const i64* row, const int* source, i64* out, i64 m, int* partial,
                                         int* flags, int* guard) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, limit = (int)row[RECV_LIMIT];
  i64 carry = 0;
  int wrong = 0;
  for (i64 c = 0; c < m; c += WARPS * 32 * ITEMS) {
    const i64 first = c + threadIdx.x * ITEMS;
    int x[ITEMS], own = 0;
#pragma unroll
    for (int j = 0; j < ITEMS; j++) x[j] = first + j < m ? __ldcg(source + first + j) : 0;  // (past L1)
#pragma unroll
    for (int j = 0; j < ITEMS; j++) {
      wrong |= x[j] < 0 || x[j] > limit;
      x[j] = min(max(x[j], 0), limit);
      own += x[j];
    }
    const int through = warp_inclusive_scan(own, lane);
    if (lane == 31) partial[warp] = through;
    __syncthreads();
    i64 at = carry + through - own, total = 0;
    for (int w = 0; w < WARPS; w++) {
      at += w < warp ? partial[w] : 0;
      total += partial[w];
    }
#pragma unroll
    for (int j = 0; j < ITEMS; j++) {
      if (first + j < m) out[first + j] = at;
      at += x[j];
    }
    carry += total;
    __syncthreads();
  }
  wrong = __syncthreads_or(wrong);
  if (threadIdx.x == 0) raise_flag(row, flags, guard, wrong || carry != row[RECV_K]);
}

}  // namespace

// `sparse_triton.bitmap_counts` and `sparse_triton.scan` in one launch: each RECV row's payload
// positions (`positions`, Triton's `starts`, at its first slot) and its checks. A bitmap row takes
// one program for every `WARPS` tiles, each warp counting a tile's marks into `counts` and flagging
// stray bits past `n`; the row's last program to finish (by `done`, one zeroed counter a row, which
// it zeroes again) scans the row's counts. Any other row takes one program, which scans the row's
// wire block counts.
template <int TILE, int WARPS>
__global__ void __launch_bounds__(WARPS * 32)
    starts(const __grid_constant__ Inline in, const i64* table, const i64* firsts, i64 boxes, int* counts,
           i64* positions, int* flags, int* guard, unsigned long long* done) {
  rows_of(in, boxes, &table, &firsts);
  __shared__ int partial[WARPS];
  __shared__ bool last;
  i64 p;
  const i64 box = find_box(firsts, boxes, &p);
  const i64* row = table + box * RECV_COLUMNS;
  const i64 first = row[RECV_FIRST], m = row[RECV_M];
  const int* wire = reinterpret_cast<const int*>(row[RECV_COUNTS]);
  if (!wire) {
    const i64 t = p * WARPS + (threadIdx.x >> 5);  // this warp's tile
    int stray = 0;
    if (t < m) {
      const int marks = tile_marks<TILE>(row, t, &stray);
      if ((threadIdx.x & 31) == 0) {
        counts[first + t] = marks;
        __threadfence();  // the count is seen before the row's counter moves
      }
    }
    stray = __syncthreads_or(stray);
    if (threadIdx.x == 0) {
      raise_flag(row, flags, guard, stray);
      last = atomicAdd(done + box, 1ull) == (unsigned long long)((m + WARPS - 1) / WARPS - 1);
      if (last) done[box] = 0;  // every program of the row has counted: zero for the buffer's next receiver
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
  }
  scan_row<WARPS, 8>(row, wire ? wire : counts + first, positions + first, m, partial, flags, guard);
}

namespace {

// The entries of wire block `b` of a blocked RECV row: its wire count, clamped to 0 .. `BLOCK` (a
// count out of range is flagged by the row's scan, in `starts`).
__device__ __forceinline__ int block_entries(const i64* row, i64 b) {
  return min(max(reinterpret_cast<const int*>(row[RECV_COUNTS])[b], 0), BLOCK);
}

}  // namespace

// `sparse_triton.blocked_check`: for each blocked RECV row, one program a wire block, its entries
// (payload positions from `positions` at the row's first slot plus the block, below `k`) checked:
// in-block offsets strictly increasing and inside the box; the row's flag raised otherwise.
template <int WARPS>
__global__ void __launch_bounds__(WARPS * 32)
    blocked_check(const __grid_constant__ Inline in, const i64* table, const i64* firsts, i64 boxes,
                  const i64* positions, int* flags, int* guard) {
  rows_of(in, boxes, &table, &firsts);
  i64 b;
  const i64* row = table + find_box(firsts, boxes, &b) * RECV_COLUMNS;
  const i64 n = row[RECV_N], k = row[RECV_K], first = positions[row[RECV_FIRST] + b];
  const unsigned short* offsets = reinterpret_cast<const unsigned short*>(row[RECV_OFFSETS]);
  const int count = block_entries(row, b);
  int wrong = 0;
  for (int j = threadIdx.x; j < count && first + j < k; j += WARPS * 32) {
    const int off = offsets[first + j], before = j > 0 ? offsets[first + j - 1] : -1;
    wrong |= off <= before || b * BLOCK + off >= n;
  }
  wrong = __syncthreads_or(wrong);
  if (threadIdx.x == 0) raise_flag(row, flags, guard, wrong);
}

// `sparse_triton.blocked_apply`: for each blocked RECV row, one program a wire block, unless `guard`
// is raised: each entry's value (payload positions as `blocked_check` reads them) into the live
// view's element at the block's start plus its offset (strided or not: one element at a time).
template <typename VT, int WARPS>
__global__ void __launch_bounds__(WARPS * 32)
    blocked_apply(const __grid_constant__ Inline in, const i64* table, const i64* firsts, i64 boxes,
                  const i64* positions, const int* guard, VT* anchor) {
  if (*guard) return;  // a box of the bucket is malformed: nothing is written
  rows_of(in, boxes, &table, &firsts);
  i64 b;
  const i64* row = table + find_box(firsts, boxes, &b) * RECV_COLUMNS;
  const i64 k = row[RECV_K], first = positions[row[RECV_FIRST] + b];
  const unsigned short* offsets = reinterpret_cast<const unsigned short*>(row[RECV_OFFSETS]);
  const VT* values = anchor + row[RECV_VALUES];
  VT* dest = anchor + row[RECV_DEST];
  // The live box's columns after its start (`Strided2D.columns`): cols, row stride, col stride, contiguous.
  const i64 cols = row[RECV_DEST + 1], row_stride = row[RECV_DEST + 2], col_stride = row[RECV_DEST + 3];
  const bool contiguous = row[RECV_DEST + 4] != 0;
  const int count = block_entries(row, b);
  for (int j = threadIdx.x; j < count && first + j < k; j += WARPS * 32) {
    const i64 i = b * BLOCK + offsets[first + j];
    dest[contiguous ? i : (i / cols) * row_stride + (i % cols) * col_stride] = values[first + j];
  }
}

namespace {

// `x` rounded up to `ALIGN` bytes (`encodings._up`).
__device__ __forceinline__ i64 aligned(i64 x) { return (x + ALIGN - 1) & -(i64)ALIGN; }

// The encoding `encodings.choose` picks for `k` changes of `n` elements of `width` bytes (the
// smallest, ties to the lower code; dense only with `dense`), its bytes, and where its values and
// positions start (`encodings.payload_layout`).
struct Choice {
  int code;
  i64 bytes, values, positions;
};

__device__ __forceinline__ Choice choose(i64 n, i64 k, i64 width, bool dense) {
  const i64 values = aligned(width * k), head = aligned((n + 7) / 8);
  Choice best = {CODE_BITMAP, head + values, head, head};
  if (n <= MAX_INDEX && aligned(4 * k) + values <= best.bytes) best = {CODE_INDICES, aligned(4 * k) + values, aligned(4 * k), 0};
  if (dense && aligned(width * n) < best.bytes) best = {CODE_DENSE, aligned(width * n), 0, 0};
  const i64 counts = aligned(4 * ((n + BLOCK - 1) / BLOCK)), offsets = aligned(2 * k);
  if (counts + offsets + values < best.bytes) best = {CODE_BLOCKED, counts + offsets + values, counts + offsets, counts};
  return best;
}

// The block-wide exclusive scan of `x` over a program of `THREADS` threads, from `*carry`, which it
// then advances by the program's sum; `sums`: a value a warp of shared memory. Every thread calls it.
template <int THREADS>
__device__ __forceinline__ i64 scan_from(i64 x, i64* sums, i64* carry) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const i64 through = warp_inclusive_scan(x, lane);
  if (lane == 31) sums[warp] = through;
  __syncthreads();
  i64 ahead = *carry + through - x;
  for (int i = 0; i < warp; i++) ahead += sums[i];
  __syncthreads();  // (every thread has read `sums` and `*carry`)
  if (threadIdx.x == THREADS - 1) *carry = ahead + x;
  __syncthreads();
  return ahead;
}

}  // namespace

// A bucket's payloads placed on the device, right behind `diff`, with no host step: one program of
// `THREADS` threads takes each SEND row of `rows` (the bucket's `diff` rows, `boxes` of them, one
// key of `width`-byte elements, in the order of their payloads), its count from `totals`, picks its
// encoding as `encodings.choose` does (`dense`: whether dense may be picked), and lays the payloads
// out one after another from `buffer` (byte address), each row's wire header (code, then its count,
// `n` for dense) in `headers`: `out` takes each row as `compact` reads it
// (values, positions and outputs in the payload; no baseline update: `diff` made it), `firsts` the
// program starts of the three density classes' `compact` launches (`sparse_table.density`: a
// program a tile, none for a dense payload or an empty indexed one), each `boxes + 1` values, and
// `placed` each row's code, byte offset and count, then the payloads' bytes in all, whether they
// fit in `capacity` bytes, and each class's programs. Payloads that do not fit leave every
// launch's last start 0: `compact` writes nothing, and the host encodes the bucket itself.
template <int TILE, int THREADS>
__global__ void __launch_bounds__(THREADS)
    place(const i64* rows, i64 boxes, const i64* totals, i64 width, i64 dense, i64 buffer, i64 capacity, i64 anchor,
          i64* out, i64* firsts, i64* placed, i64* headers) {
  __shared__ i64 sums[THREADS / 32];
  __shared__ i64 carry[4];  // bytes, then each class's programs
  if (threadIdx.x < 4) carry[threadIdx.x] = 0;
  __syncthreads();
  for (i64 first = 0; first < boxes; first += THREADS) {
    const i64 b = first + threadIdx.x;
    const bool mine = b < boxes;
    const i64* row = rows + (mine ? b : 0) * SEND_COLUMNS;
    const i64 n = mine ? row[SEND_N] : 0, k = mine ? totals[row[SEND_COUNT]] : 0;
    const Choice c = choose(n, k, width, dense != 0);
    const int cls = (k * BUSY > n) + (k * BUSIER > n);
    const bool runs = mine && c.code != CODE_DENSE && !(k == 0 && c.code == CODE_INDICES);
    const i64 programs = runs ? (n + TILE - 1) / TILE : 0;
    const i64 at = scan_from<THREADS>(mine ? c.bytes : 0, sums, carry);
    i64 starts[3];
#pragma unroll
    for (int d = 0; d < 3; d++) starts[d] = scan_from<THREADS>(cls == d ? programs : 0, sums, carry + 1 + d);
    if (!mine) continue;
    const i64 address = buffer + at;
    i64* o = out + b * SEND_COLUMNS;
    for (int col = 0; col < SEND_COLUMNS; col++) o[col] = row[col];
    o[SEND_VALUES] = (address + c.values - anchor) / width;
    o[SEND_INDEX] = c.code == CODE_BITMAP ? 0 : address + c.positions;
    o[SEND_INDEX_KIND] = c.code == CODE_BITMAP ? NO_INDEX : c.code == CODE_INDICES ? INT32_INDEX : UINT16_OFFSET;
    o[SEND_UPDATE] = 0;
    o[SEND_BITMAP_OUT] = c.code == CODE_BITMAP ? address : 0;
    o[SEND_BLOCKS_OUT] = c.code == CODE_BLOCKED ? address : 0;
#pragma unroll
    for (int d = 0; d < 3; d++) firsts[d * (boxes + 1) + b] = starts[d];
    headers[2 * b] = c.code;
    headers[2 * b + 1] = c.code == CODE_DENSE ? n : k;  // (a dense payload carries every element)
    placed[b] = c.code;
    placed[boxes + b] = at;
    placed[2 * boxes + b] = k;
  }
  if (threadIdx.x == 0) {
    const bool fits = carry[0] <= capacity;
#pragma unroll
    for (int d = 0; d < 3; d++) {
      firsts[d * (boxes + 1) + boxes] = fits ? carry[1 + d] : 0;
      placed[3 * boxes + 2 + d] = carry[1 + d];
    }
    placed[3 * boxes] = carry[0];
    placed[3 * boxes + 1] = fits;
  }
}
