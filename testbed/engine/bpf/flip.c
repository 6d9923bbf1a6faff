// SPDX-License-Identifier: Apache-2.0
/*
 * The testbed's in-kernel corruption engine: a tc (clsact, direct-action) classifier that flips bits of one
 * link direction at a bit error rate, with exact per-bit Bernoulli or Gilbert-Elliott statistics.
 * docs/engine.md, "The bpf engine", describes it; testbed/engine/bpf/ builds, loads and drives it.
 *
 * The error process is one sequential stream over the eligible bits of the direction, in packet order, as
 * in the NFQUEUE engine's link model: flips are drawn as geometric gaps from a seeded PRNG (splitmix64),
 * and the gap carries over from packet to packet. Its state (PRNG, next flip, Gilbert-Elliott state and
 * sojourn) lives in the map `tb_state` under a bpf_spin_lock, so that packets of the same direction on
 * several CPUs consume one stream:
 *
 *   - a packet reserves its bits [s, e) of the stream (cursor += nbits) under the lock;
 *   - flips are generated in stream order, under the lock, a few at a time, into the ring `tb_ring`
 *     (absolute stream positions). Whoever needs positions generates them, also for earlier packets still
 *     in flight on another CPU, so generation never waits for anyone;
 *   - each packet then reads its own flips from the ring (outside the lock: helpers may not be called
 *     under it) and writes them directly into the packet, linearized once by bpf_skb_pull_data (the whole
 *     skb, GSO super-packets included). That part is a second program, tb_apply, reached by a tail call only
 *     for packets the stream may flip: direct packet writes give a program an unclone prologue, which in
 *     tb_flip would cost every (cloned: TCP) packet.
 *
 * Gap sampling is exact: a Geometric variable G - 1 = sum_k 2^k B_k has independent binary digits B_k with
 * P(B_k = 1) = q^(2^k) / (1 + q^(2^k)), q = 1 - p. Userspace tabulates these probabilities as 64-bit
 * thresholds (tb_config); a digit is one 64-bit draw compared with its threshold (branch-free).
 */
#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <linux/if_ether.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define NSLOTS 8
#define NDIG 64
#define RING_BITS 16
#define RING (1u << RING_BITS)
#define RING_MASK (RING - 1)
#define NEPOCHS 64
#define NPORTS 16
#define NEVER (1ULL << 62)
#define PENDING (NEVER + 1)  /* next_flip: the sojourn's first gap is not drawn yet */
#define GEN_PER_LOCK 4     /* flips or sojourn switches generated per lock section */
#define APPLY_PER_STEP 4   /* flips applied per bpf_loop step (more events per step cost verifier time: 8 and 8 took 1 s to load) */
#define MAX_STEPS (1 << 22)
#define MAXTAIL 128        /* counterflips.MAX_TAIL */
#define BLOCK_SHIFT 12     /* counterflips.BLOCK_BITS = 4096 */

#define T_GOOD_FLIP 0
#define T_BAD_FLIP 1
#define T_GOOD_LEN 2
#define T_BAD_LEN 3

#define SCOPE_PAYLOAD 0
#define SCOPE_ALL 1
#define SCOPE_TENSOR 2
#define CSUM_FIX 0
#define CSUM_KEEP 1

/* counters (per CPU; userspace sums them) */
enum {
	C_PACKETS, C_BYTES, C_MODIFIED, C_MULTIFLIP, C_UNPARSED,
	C_U_SHORT, C_U_NOT_IPV4, C_U_BAD_IHL, C_U_BAD_LENGTH, C_U_FRAGMENT, C_U_NOT_TCP_UDP, C_U_BAD_L4,
	C_ERRORS, C_RETX_BITS, C_FLOWS, C_FLOWS_EXCLUDED, C_GSO, C_KEEP_GSO_PASSED, C_OVERRUNS,
	C_FLIPS_ON_CSUM, C_FLIPS_APPLIED, C_SHARED, C_GSO_BITS, C_GSO_FLIPS, C_UNCLONE_FAILED, C_HOLE_BITS,
	C_HOLES_LOST,
	/* keyed flips (tb_keyed) */
	C_RETX_FLIPS, C_MIDSTREAM, C_DESYNCED, C_DESYNC_OOO, C_STALE_BITS, C_RANGES_LOST_BITS, C_BITS_PROTECTED,
	C_FLIPS_PROTECTED, C_FLIPS_CORRECTED, C_FLIPS_SIGN, C_FLIPS_EXPONENT, C_FLIPS_MANTISSA, C_HEADER_BYTES,
	C_FRAMES, C_DATA_FRAMES, C_KFLOWS_LOST, C_KHOLES, C_N
};
#define NCOUNTERS 64

struct table {
	__u64 ndig;   /* digits to draw (the rest have threshold 0) */
	__u64 never;  /* p == 0: no event ever */
	__u64 thr[NDIG];
};

struct cfg {
	__u64 version;
	__u64 ber_bits;    /* the configured (mean) BER as an IEEE double, copied into the epoch log */
	__u64 generation;  /* reseed when it changes (error model or seed changed) */
	__u64 seed;
	__u64 scope;
	__u64 checksum;
	__u64 skip_retx;   /* TCP payload already sent once passes clean (scope payload, checksum fix) */
	__u64 pi_bad;      /* P(the chain starts in the bad state) as a 64-bit threshold */
	__u64 new_epoch;   /* BER, error model or seed changed: the model restarts here, a new epoch begins */
	__u64 nports;
	__u64 ports[NPORTS];
	struct table t[4];
	/* keyed flips (tb_keyed, see there): flips as a pure function of (key, stream position) */
	__u64 keyed;       /* 1: TCP (and UDP) flips by the counter function, not the sequential stream */
	__u64 fk[2];       /* base key of flows: counterflips.key_of(seed, TAG_FLOW, generation) */
	__u64 lk[2];       /* key of the direction's packet-order stream (UDP): key_of(seed, TAG_LINK, generation) */
	__u64 codes;       /* scope tensor: bit c set = payload of collective slot code c eligible */
	__u64 vbits;       /* element bits (32 fp32, 16 bf16/fp16) */
	__u64 pmask;       /* engine-bit slots (MSB first within each byte) that are protected */
	__u64 smask;       /* ... that hold the sign */
	__u64 emask;       /* ... that hold the exponent */
	__u64 resid;       /* a flip on a protected slot is kept iff hash >> 11 < resid (2^53: all) */
	__u64 salt_seed;   /* the engine's seed, for the residual decisions' flow salt */
	__u64 max_frame;   /* largest data frame gloo may send (the tracker's max_frame_bytes) */
	__u64 ntail;       /* count table: the block holds >= k flips iff u < tail[k-1] */
	__u64 tail[MAXTAIL];
};

struct config {
	__u64 version;     /* the slot in force is slot[version % NSLOTS] */
	__u64 pad;
	struct cfg slot[NSLOTS];
};

struct epoch {
	__u64 version;
	__u64 ber_bits;
	__u64 start_bits;
	__u64 start_flips;
	__u64 ktime;
};

struct state {
	struct bpf_spin_lock lock;
	__u32 pad0;
	__u64 applied;     /* config version in force (0: none yet) */
	__u64 slot;
	__u64 generation;
	__u64 rng;
	__u64 cursor;      /* eligible bits reserved by packets */
	__u64 gen_pos;     /* every flip below gen_pos is in the ring */
	__u64 gen_idx;     /* flips generated (ring index of the next one) */
	__u64 next_flip;   /* the next flip of the current sojourn, or beyond its end */
	__u64 bad;         /* Gilbert-Elliott state (0 good, 1 bad; Bernoulli: good forever) */
	__u64 soj_start;
	__u64 soj_end;     /* first bit of the next sojourn */
	__u64 bad_sojourns;
	__u64 bad_sojourn_bits;
	__u64 nepochs;
	struct epoch epochs[NEPOCHS];
	__u64 kbits;       /* keyed flips: eligible bits seen (first transmissions), flips drawn on them */
	__u64 kflips;
	__u64 ucursor;     /* keyed flips: the packet-order stream position of UDP payload (bits) */
};

struct ring {
	__u64 pos[RING];
};

struct counters {
	__u64 v[NCOUNTERS];
};

struct lctx {
	struct __sk_buff *skb;
};

/* Per-packet work of the bpf_loop steps. It lives in a per-CPU map, not on the stack: the verifier does
 * not track map memory, so the loop's states converge instead of differing by every counter value. (tc
 * programs do not nest on one CPU: egress runs with BHs off, ingress in softirq.) */
struct pctx {
	__u64 s, e;      /* the packet's bits of the stream */
	__u64 idx;       /* next ring index to look at */
	__u64 flips;
	__u64 applied;
	__u64 on_csum;
	__u64 shared;    /* flips of earlier packets met in the ring (their generation was shared) */
	__u64 d_l4;      /* ones'-complement change of the L4 bytes (memory order words) */
	__u64 d_ps;      /* change of the pseudo-header fields (scope all) */
	__u32 base;      /* skb offset of the first eligible byte */
	__u32 l3, l4, csum_off, end;
	__u32 fix_all;   /* fix + scope all: flips on checksum fields are drawn and counted, not applied */
	__u32 iphdr;     /* an IP header byte was flipped */
	__u32 pulled;    /* pulls done: the first up to the flip's byte, the second the whole packet */
	__u32 err;
	__u32 overrun;
	__u32 udp;
	__u32 keep;      /* checksum keep (else fix) */
	__u32 gso;       /* a GSO super-packet (its bits and flips are counted apart: realized BER per class) */
};


struct flow_key {
	__u32 saddr;
	__u32 daddr;
	__u16 sport;
	__u16 dport;
	__u32 proto;
};

/* Sequence ranges above which a later segment came first: a segment reordered on the way to the hook (veth
 * enqueues to the backlog of the CPU the sender runs on, so a sender that moves between CPUs has its segments
 * handed on out of order) or lost before it (its retransmission is its first copy here). Bytes in a hole are
 * new, not retransmitted. */
#define NHOLES 4

struct flow {
	__u32 next_seq;
	__u32 flags;
	__u32 nholes;
	__u32 pad;
	__u32 hole_lo[NHOLES];
	__u32 hole_hi[NHOLES];
};
#define F_SEQ 1
#define F_EXCLUDED_COUNTED 2

/* The maps of this file: one-entry arrays (configuration, state, per-CPU counters and scratch) and LRU hashes */
#define ONE(kind, vtype, name)                                                                             \
	struct {                                                                                             \
		__uint(type, BPF_MAP_TYPE_##kind);                                                            \
		__uint(max_entries, 1);                                                                      \
		__type(key, __u32);                                                                          \
		__type(value, vtype);                                                                        \
	} name SEC(".maps")
#define LRU(n, ktype, vtype, name)                                                                         \
	struct {                                                                                             \
		__uint(type, BPF_MAP_TYPE_LRU_HASH);                                                          \
		__uint(max_entries, n);                                                                      \
		__type(key, ktype);                                                                          \
		__type(value, vtype);                                                                        \
	} name SEC(".maps")

ONE(ARRAY, struct config, tb_config);

ONE(ARRAY, struct state, tb_state);

ONE(ARRAY, struct ring, tb_ring);

ONE(PERCPU_ARRAY, struct counters, tb_counters);

ONE(PERCPU_ARRAY, struct pctx, tb_scratch);

LRU(16384, struct flow_key, struct flow, tb_flows);

/* The flip applier, a second program reached by a tail call only for packets whose bits hold flips. It writes the
 * flipped bytes directly into the packet; a program that writes packet data directly gets a prologue from the
 * verifier that unclones every cloned skb it runs on (TCP's are: the original stays in the retransmission
 * queue), so the writes live there and not in tb_flip, which every packet runs. */
int tb_apply(struct __sk_buff *skb);

int tb_keyed(struct __sk_buff *skb);
int tb_kapply(struct __sk_buff *skb);

struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, 3);
	__uint(key_size, sizeof(__u32));
	__array(values, int (void *));
} tb_progs SEC(".maps") = {
	.values = { [0] = (void *)&tb_apply, [1] = (void *)&tb_keyed, [2] = (void *)&tb_kapply },
};

#define READ_ONCE(x) (*(volatile typeof(x) *)&(x))

/* splitmix64 (Steele, Lea, Flood 2014) */
static __always_inline __u64 mix64(__u64 z)
{
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
}

static __always_inline __u64 next64(__u64 *s)
{
	*s += 0x9e3779b97f4a7c15ULL;
	return mix64(*s);
}

/* a < b (unsigned) as 0/1 without a branch (a branch per digit would multiply the verifier's paths) */
static __always_inline __u64 ult(__u64 a, __u64 b)
{
	__u64 d = a - b;
	__u64 na = ~a;

	asm volatile("" : "+r"(d), "+r"(na));
	return ((na & b) | ((na | b) & d)) >> 63;
}

#define DIGITS(N)                                                  \
	do {                                                           \
		_Pragma("clang loop unroll(disable)")                    \
		for (int k = 0; k < (N); k++)                          \
			x |= ult(next64(&r), t->thr[k]) << k;          \
	} while (0)

/* Geometric(p) on {1, 2, ...}: 1 + sum_k 2^k B_k with B_k ~ Bernoulli(thr[k] / 2^64), independent.
 * The digits are drawn in blocks of fixed length (8, 16, 32, 64: the first that holds ndig; thresholds past
 * ndig are 0), so that no branch depends on a drawn value. */
static __always_inline __u64 gap(__u64 *rng, struct table *t)
{
	__u64 n, r, x = 0;

	if (t->never)
		return NEVER;
	n = t->ndig;
	r = *rng;
	if (n <= 8)
		DIGITS(8);
	else if (n <= 16)
		DIGITS(16);
	else if (n <= 32)
		DIGITS(32);
	else
		DIGITS(64);
	*rng = r;
	return x + 1;
}

static __always_inline __u64 addc(__u64 a, __u64 g)
{
	__u64 r = a + g;

	return (g >= NEVER || r >= NEVER) ? NEVER : r;
}

/* A new configuration takes effect at the current stream position (under the lock, nothing pending). A
 * change of scope, checksum or control ports only switches the slot; a change of the BER keeps the PRNG and
 * the Gilbert-Elliott state and redraws the rest of the sojourn and the gap to the next flip from here
 * (memoryless: the same distribution); a new error model or seed (generation) reseeds. */
static __always_inline void apply_cfg(struct state *st, struct cfg *c, __u64 ver, __u64 now)
{
	__u64 pos = st->cursor, rng, bad, n;
	struct epoch *ep;

	st->applied = ver;
	st->slot = ver & (NSLOTS - 1);
	if (st->nepochs && !c->new_epoch && c->generation == st->generation)
		return;
	if (!st->nepochs || c->generation != st->generation) {
		rng = mix64(c->seed ^ mix64(c->generation + 0x5851f42d4c957f2dULL));
		st->generation = c->generation;
		bad = ult(next64(&rng), c->pi_bad);
		st->bad = bad;
		st->soj_start = pos;
	} else {
		rng = st->rng;
		bad = st->bad & 1;
	}
	st->soj_end = addc(pos, gap(&rng, &c->t[bad ? T_BAD_LEN : T_GOOD_LEN]));
	st->next_flip = addc(pos - 1, gap(&rng, &c->t[bad ? T_BAD_FLIP : T_GOOD_FLIP]));
	st->rng = rng;
	st->gen_pos = pos;
	n = st->nepochs;
	ep = &st->epochs[n & (NEPOCHS - 1)];
	ep->version = ver;
	ep->ber_bits = c->ber_bits;
	ep->start_bits = pos;
	ep->start_flips = st->gen_idx;
	ep->ktime = now;
	st->nepochs = n + 1;
}

/* Extend the stream's flips (in order, into the ring) towards stream position e; a bounded amount. Each event
 * draws one gap (a sojourn switch draws the sojourn's length; the first gap of its flips, PENDING until then,
 * is the next event), so that the verifier meets one gap() per iteration, not three. */
static __always_inline void generate(struct state *st, struct cfg *c, struct ring *rg, __u64 e)
{
	__u64 rng = st->rng;

	for (int i = 0; i < GEN_PER_LOCK; i++) {
		__u64 gp = st->gen_pos, nf, se, bad, base, ti, g;

		if (gp >= e)
			break;
		nf = st->next_flip;
		se = st->soj_end;
		bad = st->bad & 1;
		if (nf == PENDING) {
			base = st->soj_start - 1;
			ti = bad ? T_BAD_FLIP : T_GOOD_FLIP;
		} else if (nf < se && nf < e) {
			__u64 gi = st->gen_idx;

			rg->pos[gi & RING_MASK] = nf;
			st->gen_idx = gi + 1;
			st->gen_pos = nf + 1;
			base = nf;
			ti = bad ? T_BAD_FLIP : T_GOOD_FLIP;
		} else if (se < e) {
			if (bad) {
				st->bad_sojourns += 1;
				st->bad_sojourn_bits += se - st->soj_start;
			}
			bad ^= 1;
			st->bad = bad;
			st->soj_start = se;
			st->gen_pos = se;
			st->next_flip = PENDING;
			base = se;
			ti = bad ? T_BAD_LEN : T_GOOD_LEN;
		} else {
			st->gen_pos = e;
			break;
		}
		g = addc(base, gap(&rng, &c->t[ti & 3]));
		if (ti == T_GOOD_LEN || ti == T_BAD_LEN)
			st->soj_end = g;
		else
			st->next_flip = g;
	}
	st->rng = rng;
}

/* byte `off` is not in the skb's linear part (or past the verifier's packet range) */
static __always_inline int beyond_linear(struct __sk_buff *skb, __u32 off)
{
	__u8 *data = (__u8 *)(long)skb->data, *dend = (__u8 *)(long)skb->data_end;
	__u32 o = off & 0xffff;

	return o != off || o >= 0xffff || data + o + 1 > dend;
}

/* Flip `mask` in byte `off` with the load/store helpers (they make a cloned skb private, pulling up to the
 * byte); `*before` gets the byte before the flip. 0, or -1 if a helper failed. No direct packet write: usable
 * in a program that must not get the verifier's unclone prologue. */
static __always_inline int poke_helpers(struct __sk_buff *skb, __u32 off, __u8 mask, __u8 *before)
{
	__u8 b;

	if (bpf_skb_load_bytes(skb, off, &b, 1))
		return -1;
	*before = b;
	b ^= mask;
	return bpf_skb_store_bytes(skb, off, &b, 1, 0) ? -1 : 0;
}

/* The same with a direct write where the byte is in the linear part (a program calling this gets the unclone
 * prologue: the skb must be private before, or the prologue copies it); the verifier sets a packet range only
 * for offsets + size <= 0xffff, so the last bytes of a 64 KB packet take the helpers. */
static __always_inline int poke(struct __sk_buff *skb, __u32 off, __u8 mask, __u8 *before)
{
	__u8 *data = (__u8 *)(long)skb->data, *dend = (__u8 *)(long)skb->data_end, *p;
	__u32 o = off & 0xffff;

	p = data + o;
	if (o == off && o < 0xffff && p + 1 <= dend) {
		*before = *p;
		*p = *before ^ mask;
		return 0;
	}
	return poke_helpers(skb, off, mask, before);
}

/* The ones'-complement change of flipping `mask` in byte `off` whose value was `b`: 16-bit words as the kernel
 * sums them (little-endian loads): an even offset is the low byte. */
static __always_inline __u64 csum_delta(__u32 off, __u8 mask, __u8 b)
{
	__u64 m = (off & 1) ? ((__u64)mask << 8) : mask;

	return (b & mask) ? (0xffff ^ m) : m;
}

/* Byte `off` beyond the linear part: make it linear (and private) up to this byte the first time, all of it the
 * second. The pull copies what it makes linear, so a packet with one flip (most at low BERs) copies half of
 * itself on average, not all; a packet with many flips pays one small extra copy. */
static __always_inline void pull_to(struct __sk_buff *skb, __u32 off, __u32 *pulled, __u32 *err)
{
	__u32 n;

	if (*pulled >= 2 || !beyond_linear(skb, off))
		return;
	n = *pulled ? skb->len : off + 1;
	*pulled += 1;
	if (bpf_skb_pull_data(skb, n))
		*err = 1;
}

static __always_inline void flip_one(struct __sk_buff *skb, struct pctx *x, __u64 q)
{
	__u32 off = x->base + (__u32)(q >> 3);
	__u8 mask = 0x80 >> (q & 7), b;
	__u64 dd;

	x->flips++;
	if (x->fix_all && ((off >= x->l3 + 10 && off < x->l3 + 12) ||
			   (x->csum_off && off >= x->csum_off && off < x->csum_off + 2))) {
		x->on_csum++;  /* the checksum is made valid anyway (as the NFQUEUE engine overwrites it) */
		return;
	}
	pull_to(skb, off, &x->pulled, &x->err);
	/* direct packet access: the linear part is private after a pull (tb_apply's prologue uncloned the skb, if
	 * tb_flip had not pulled already) */
	if (poke(skb, off, mask, &b)) {
		x->err = 1;
		return;
	}
	dd = csum_delta(off, mask, b);
	x->applied++;
	if (off >= x->l4) {
		x->d_l4 += dd;
	} else {
		__u32 r = off - x->l3;

		x->iphdr = 1;
		if (r == 2 || r == 3 || r == 9 || (r >= 12 && r < 20))
			x->d_ps += dd;
	}
}

/* One bpf_loop step: generate at most GEN_PER_LOCK events (flips or sojourn switches) under the lock, then
 * apply at most APPLY_PER_STEP flips of this packet from the ring. Bounded steps keep the verifier's work (and
 * lock hold times) small; several events per step keep the lock and loop overhead per flip small. */
static long step(__u64 i, void *arg)
{
	struct lctx *lc = arg;
	__u32 zero = 0;
	struct pctx *x = bpf_map_lookup_elem(&tb_scratch, &zero);
	struct config *cf = bpf_map_lookup_elem(&tb_config, &zero);
	struct state *st = bpf_map_lookup_elem(&tb_state, &zero);
	struct ring *rg = bpf_map_lookup_elem(&tb_ring, &zero);
	__u64 gp, gi, idx, pos;

	if (!x || !cf || !st || !rg)
		return 1;
	bpf_spin_lock(&st->lock);
	if (st->gen_pos < x->e)
		generate(st, &cf->slot[st->slot & (NSLOTS - 1)], rg, x->e);
	gp = st->gen_pos;
	gi = st->gen_idx;
	bpf_spin_unlock(&st->lock);

	for (int j = 0; j < APPLY_PER_STEP; j++) {
		idx = x->idx;
		if (idx >= gi)  /* nothing new to read: done once the stream is generated past the packet */
			return gp >= x->e ? 1 : 0;
		if (gi - idx > RING) {  /* overwritten before it was read (needs 64 Ki flips in flight: never seen) */
			x->overrun = 1;
			return 1;
		}
		pos = rg->pos[idx & RING_MASK];
		if (pos >= x->e)
			return 1;
		x->idx = idx + 1;
		if (pos >= x->s)
			flip_one(lc->skb, x, pos - x->s);
		else  /* an earlier packet's flip: that packet was in flight on another CPU */
			x->shared++;
	}
	return 0;
}

static __always_inline void count(struct counters *cn, int i)
{
	if (i >= 0 && i < NCOUNTERS)
		cn->v[i] += 1;
}

static __always_inline int unparsed(struct counters *cn, int reason)
{
	cn->v[C_UNPARSED] += 1;
	count(cn, reason);
	return TC_ACT_OK;
}

static __always_inline __u64 fold(__u64 s)
{
	s = (s & 0xffffffff) + (s >> 32);
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	return s;
}

static __always_inline int after(__u32 a, __u32 b)
{
	return (__s32)(a - b) > 0;
}

/* A TCP segment [seq, seq + plen) of a tracked flow: which of its bytes are new (first seen here), as one range
 * [skip, skip + keep) of the payload; the rest is a retransmission and passes clean. New: beyond the highest
 * sequence number seen (a gap before it becomes a hole), or inside a hole (the hole shrinks). A segment that
 * is new in two places (across a hole's edge and beyond, or two holes: re-segmented retransmissions of
 * reordered data) counts the first; the other new bytes are counted as lost hole bits. */
static __always_inline void new_range(struct flow *fl, struct counters *cn, __u32 seq, __u32 plen, __u32 *skip,
				      __u32 *keep)
{
	__u32 end = seq + plen, ns = fl->next_seq;

	if (!after(ns, seq)) {  /* all new */
		if (after(seq, ns)) {  /* a gap: later bytes came first */
			__u32 k = fl->nholes;

			if (k < NHOLES) {
				fl->hole_lo[k & (NHOLES - 1)] = ns;
				fl->hole_hi[k & (NHOLES - 1)] = seq;
				fl->nholes = k + 1;
			} else {
				cn->v[C_HOLES_LOST] += 1;
			}
		}
		fl->next_seq = end;
		*skip = 0;
		*keep = plen;
		return;
	}
	if (after(end, ns)) {  /* the tail is new */
		*skip = ns - seq;
		*keep = end - ns;
		fl->next_seq = end;
		return;
	}
	*skip = plen;  /* all below the highest seen: new only where it meets a hole */
	*keep = 0;
	for (int i = 0; i < NHOLES; i++) {
		__u32 lo, hi, a, b, k = fl->nholes;

		if (i >= k)
			break;
		lo = fl->hole_lo[i];
		hi = fl->hole_hi[i];
		if (!after(end, lo) || !after(hi, seq))
			continue;
		a = after(seq, lo) ? seq : lo;
		b = after(end, hi) ? hi : end;
		*skip = a - seq;
		*keep = b - a;
		cn->v[C_HOLE_BITS] += (__u64)(b - a) << 3;
		if (a == lo && b == hi) {  /* filled: the last hole takes its slot */
			__u32 j = (k - 1) & (NHOLES - 1);

			fl->hole_lo[i] = fl->hole_lo[j];
			fl->hole_hi[i] = fl->hole_hi[j];
			fl->nholes = k - 1;
		} else if (a == lo) {
			fl->hole_lo[i] = b;
		} else if (b == hi) {
			fl->hole_hi[i] = a;
		} else if (k < NHOLES) {  /* the middle of it: two holes */
			fl->hole_hi[i] = a;
			fl->hole_lo[k & (NHOLES - 1)] = b;
			fl->hole_hi[k & (NHOLES - 1)] = hi;
			fl->nholes = k + 1;
		} else {
			fl->hole_hi[i] = a;
			cn->v[C_HOLES_LOST] += 1;
		}
		break;
	}
}

/* ---- Keyed flips: a pure function of (key, stream position) (docs/engine.md, "Keyed flips") -------------------
 *
 * With cfg.keyed, TCP flips are not drawn from the sequential stream but computed, as in
 * testbed/engine/counterflips.py: per block of 4096 bits of a flow's stream (by byte offset from the ISN, or by
 * eligible-byte offset in scope tensor), Philox4x32-10 under the flow's key at counter (block, 0, j, 0) gives
 * the block's flip count (inverse CDF against the binomial tail table) and its positions (further words mod
 * 4096, repeats skipped). A flow's key is Philox of its identity words (ordinal among the open connections of
 * its address pair, the two addresses, 0: the NFQUEUE engine's FlowState.identity) under the engine's base key.
 * So a retransmission gets its original's flips, segment boundaries do not matter, and the NFQUEUE engine with
 * error_model counter gives the same flips for the same stream.
 *
 * Scope tensor follows gloo's framing per flow (testbed/engine/gloo.py's GlooStreamTracker, same rules): the
 * initiator's 8-byte handshake, then 48-byte headers (a header split across segments is gathered in the flow),
 * data frames' payload eligible when their collective code is in cfg.codes. In-order bytes are parsed; bytes
 * sent again are answered from a record of the last NREC eligible frames (older ones pass clean, counted as
 * stale); a segment beyond the parsed frontier, or a header gloo would not write, desyncs the flow for good
 * (fail closed: its packets pass clean, counted). No direct packet writes here (no unclone prologue): flips
 * go through bpf_skb_load_bytes/bpf_skb_store_bytes, which make a cloned skb private only when they write. */
#define NREC 16
#define NRANGES 32
#define NFLIP 2048         /* flips a packet's list holds for tb_kapply's direct writes (more: written by helpers) */
#define MAX_WORDS_J 1024   /* Philox calls a block may use for positions (repeats included) */
#define KF_BASE 1
#define KF_SYN 2           /* the SYN passed here: ordinal and tracker valid */
#define KF_INIT 4          /* the initiator's direction (SYN without ACK): starts with the handshake */
#define KF_DESYNC 8
#define KF_CLOSED 16
#define KF_MID_COUNTED 32
#define KF_ORD 64          /* holds its ordinal in tb_pairs */
#define ST_HANDSHAKE 0
#define ST_HEADER 1
#define ST_PAYLOAD 2

struct krec {
	__u64 s, e, origin, shift;
};

struct kflow {
	__u32 base, flags, ordinal, state;
	__u64 top;         /* highest stream offset seen (exclusive) */
	__u64 frontier;    /* scope tensor: bytes [0, frontier) parsed */
	__u64 pay_end, origin, shift, elig, horizon;
	__u64 hole_lo, hole_hi;  /* payload bytes skipped by an out-of-order segment inside the same frame */
	__u32 need, hlen, pay_ok, nrec;
	__u8 hbuf[64];
	struct krec rec[NREC];
};

struct pair_key {
	__u32 saddr, daddr;
};

struct krange {
	__u64 s, e, origin, shift, retx;
};

struct kx {
	struct flow_key k;
	__u64 ver;
	__u64 off;         /* stream offset of the payload's first byte */
	__u32 l3, l4, pay, plen, csum_off, udp, seq, tflags;
	__u32 k0, k1;      /* the flow's key */
	__u64 salt;        /* the flow's salt for residual decisions */
	__u32 nr, ri, pp, started;
	struct krange r[NRANGES];
	__u64 blk, blk_end, ke, ke_end, base_byte;
	__u32 need, npos, wj, err, pulled, nfo, maxoff;
	__u64 d_l4, flips, retx_flips, applied, newbits;
	__u32 fo[NFLIP];   /* the flips for tb_kapply: skb offset << 3 | bit (0 = the byte's MSB) */
	__u64 f_prot, f_corr, f_sign, f_exp, f_mant;
	__u16 pos[MAXTAIL];
	__u64 bm[64];      /* the block's positions drawn so far (repeats are skipped) */
	__u8 tmp[64];
	struct kflow blank;  /* never written: a new flow's value (too large for the stack) */
};

ONE(PERCPU_ARRAY, struct kx, tb_kscratch);

LRU(1024, struct flow_key, struct kflow, tb_kflows);

LRU(1024, struct pair_key, __u64, tb_pairs);

/* Philox4x32-10 (Salmon et al., SC'11) at counter (blk low, blk high, j, c3): counterflips.philox4x32 */
static __always_inline void philox(__u32 w[4], __u64 blk, __u32 j, __u32 c3, __u32 k0, __u32 k1)
{
	__u32 c0 = (__u32)blk, c1 = (__u32)(blk >> 32), c2 = j;

#pragma clang loop unroll(full)
	for (int r = 0; r < 10; r++) {
		__u64 p0 = (__u64)0xD2511F53 * c0, p1 = (__u64)0xCD9E8D57 * c2;
		__u32 n0 = (__u32)(p1 >> 32) ^ c1 ^ k0, n2 = (__u32)(p0 >> 32) ^ c3 ^ k1;

		c1 = (__u32)p1;
		c3 = (__u32)p0;
		c0 = n0;
		c2 = n2;
		k0 += 0x9E3779B9;
		k1 += 0xBB67AE85;
	}
	w[0] = c0;
	w[1] = c1;
	w[2] = c2;
	w[3] = c3;
}

static __always_inline __u64 mix64p(__u64 x)  /* protect._mix64: splitmix64's increment and finalizer */
{
	return mix64(x + 0x9e3779b97f4a7c15ULL);
}

/* the lowest ordinal not held by another open connection of the address pair (FlowTable.number) */
static __always_inline __u32 take_ordinal(struct flow_key *k)
{
	struct pair_key pk = {.saddr = k->saddr, .daddr = k->daddr};
	__u64 *held = bpf_map_lookup_elem(&tb_pairs, &pk), zero = 0;
	__u32 i;

	if (!held) {
		bpf_map_update_elem(&tb_pairs, &pk, &zero, BPF_NOEXIST);
		held = bpf_map_lookup_elem(&tb_pairs, &pk);
		if (!held)
			return 63;
	}
	for (i = 0; i < 63; i++)
		if (!((*held >> i) & 1))
			break;
	__sync_fetch_and_or(held, 1ULL << i);
	return i;
}

static __always_inline void release_ordinal(struct flow_key *k, struct kflow *fl)
{
	struct pair_key pk = {.saddr = k->saddr, .daddr = k->daddr};
	__u64 *held;

	if (!(fl->flags & KF_ORD))
		return;
	fl->flags &= ~KF_ORD;
	held = bpf_map_lookup_elem(&tb_pairs, &pk);
	if (held && fl->ordinal < 63)
		__sync_fetch_and_and(held, ~(1ULL << fl->ordinal));
}

static __always_inline void add_range(struct kx *x, struct counters *cn, __u64 s, __u64 e, __u64 origin, __u64 shift,
				      __u64 retx)
{
	__u32 n = x->nr;
	struct krange *r;

	if (n >= NRANGES) {  /* more eligible pieces than a packet's scratch holds: they pass clean, counted */
		cn->v[C_RANGES_LOST_BITS] += (e - s) << 3;
		return;
	}
	r = &x->r[n & (NRANGES - 1)];
	r->s = s;
	r->e = e;
	r->origin = origin;
	r->shift = shift;
	r->retx = retx;
	x->nr = n + 1;
}

/* A recorded piece [s, e): sent again, except where it falls in the flow's hole (bytes an out-of-order segment
 * skipped inside one frame's payload: their first transmission, new), which shrinks from either end. */
static __always_inline void add_recorded(struct kx *x, struct kflow *fl, struct counters *cn, struct krec *r, __u64 s,
					 __u64 e)
{
	__u64 hl = fl->hole_lo, hh = fl->hole_hi, a, b;

	if (!hh || e <= hl || s >= hh) {
		add_range(x, cn, s, e, r->origin, r->shift, 1);
		return;
	}
	a = s > hl ? s : hl;
	b = e < hh ? e : hh;
	if (s < a)
		add_range(x, cn, s, a, r->origin, r->shift, 1);
	add_range(x, cn, a, b, r->origin, r->shift, 0);
	if (b < e)
		add_range(x, cn, b, e, r->origin, r->shift, 1);
	if (a == hl && b == hh)
		fl->hole_lo = fl->hole_hi = 0;
	else if (a == hl)
		fl->hole_lo = b;
	else if (b == hh)
		fl->hole_hi = a;
}

/* Bytes [a, b) below the frontier, sent again: the eligible pieces of the recorded frames */
static __always_inline void lookup(struct kx *x, struct kflow *fl, struct counters *cn, __u64 a, __u64 b)
{
	__u32 n = fl->nrec;

	if (a < fl->horizon) {
		__u64 cut = b < fl->horizon ? b : fl->horizon;

		cn->v[C_STALE_BITS] += (cut - a) << 3;
		a = cut;
	}
	if (a >= b)
		return;
	for (int i = 0; i < NREC; i++) {
		struct krec *r = &fl->rec[i];
		__u64 s, e;

		if (i >= n)
			break;
		s = r->s > a ? r->s : a;
		e = r->e < b ? r->e : b;
		if (s < e)
			add_recorded(x, fl, cn, r, s, e);
	}
}

struct kctx {
	struct __sk_buff *skb;
};

/* the loop steps' maps (map value pointers do not survive the loop's context: looked up per step) */
#define KSTEP_MAPS(kc)                                                                        \
	__u32 zero = 0;                                                                      \
	struct kx *x = bpf_map_lookup_elem(&tb_kscratch, &zero);                              \
	struct config *cf = bpf_map_lookup_elem(&tb_config, &zero);                           \
	struct counters *cn = bpf_map_lookup_elem(&tb_counters, &zero);                       \
	struct cfg *c;                                                                       \
	if (!x || !cf || !cn)                                                                \
		return 1;                                                                    \
	c = &cf->slot[x->ver & (NSLOTS - 1)];

static __always_inline __u64 le64(struct kflow *fl, int i)
{
	__u64 v;

	__builtin_memcpy(&v, &fl->hbuf[(i * 8) & 63], 8);
	return v;
}

/* gloo.header_problem: 0 when gloo (as torch uses it) may write this header */
static __always_inline int bad_header(struct kflow *fl, struct cfg *c)
{
	__u64 nbytes = le64(fl, 0), opcode = le64(fl, 1), slot = le64(fl, 2), offset = le64(fl, 3);
	__u64 length = le64(fl, 4), roffset = le64(fl, 5), code = slot >> 56;

	if (opcode == 0 || opcode == 1) {
		if (nbytes != 48 + length || length > c->max_frame)
			return 1;
		if (opcode == 1 && (offset || roffset))
			return 1;
		if (opcode == 0 && (offset >= (1ULL << 48) || roffset >= (1ULL << 48)))
			return 1;
	} else if (opcode == 2 || opcode == 3) {
		if (nbytes != 48 || offset || roffset || length >= (1ULL << 48))
			return 1;
	} else {
		return 1;
	}
	if (code == 0)
		return (slot >> 32) != 0;
	if (code <= 8)
		return (slot & (0xFFFFULL << 8)) != 0;
	return 1;
}

/* One step of the tracker over the packet's payload (GlooStreamTracker._parse): a piece of a frame's payload,
 * or (part of) a handshake or header. Returns 1 when the packet is done. */
static long kparse(__u64 i, void *arg)
{
	struct kctx *kc = arg;
	KSTEP_MAPS(kc)
	struct kflow *fl = bpf_map_lookup_elem(&tb_kflows, &x->k);
	__u64 f, take;
	__u32 pp = x->pp, rem, need, hlen, tk;

	if (!fl)
		return 1;
	f = fl->frontier;
	if ((fl->flags & KF_DESYNC) || pp >= x->plen)
		return 1;
	rem = x->plen - pp;
	if (fl->state == ST_PAYLOAD) {
		take = fl->pay_end - f;
		if (take > rem)
			take = rem;
		if (fl->pay_ok) {
			add_range(x, cn, f, f + take, fl->origin, fl->shift, 0);
			fl->elig += take;
		}
		f += take;
		x->pp = pp + (__u32)take;
		if (f == fl->pay_end) {
			fl->state = ST_HEADER;
			fl->need = 48;
		}
		fl->frontier = f;
		return 0;
	}
	need = fl->need;
	hlen = fl->hlen;
	if (need > 48 || hlen >= need)
		return 1;
	tk = need - hlen;
	if (tk > rem)
		tk = rem;
	if (tk < 1 || tk > 48)
		return 1;
	if (bpf_skb_load_bytes(kc->skb, x->pay + pp, x->tmp, tk)) {
		x->err = 1;
		return 1;
	}
	for (int j = 0; j < 48; j++) {
		if (j >= tk)
			break;
		fl->hbuf[(hlen + j) & 63] = x->tmp[j & 63];
	}
	hlen += tk;
	f += tk;
	x->pp = pp + tk;
	cn->v[C_HEADER_BYTES] += tk;
	fl->frontier = f;
	if (hlen < need) {
		fl->hlen = hlen;
		return 1;
	}
	fl->hlen = 0;
	if (fl->state == ST_HANDSHAKE) {
		if (le64(fl, 0) >= (1ULL << 31)) {  /* negative or too large: not gloo's sequence number */
			fl->flags |= KF_DESYNC;
			cn->v[C_DESYNCED] += 1;
			return 1;
		}
		fl->state = ST_HEADER;
		fl->need = 48;
		return 0;
	}
	if (bad_header(fl, c)) {
		fl->flags |= KF_DESYNC;
		cn->v[C_DESYNCED] += 1;
		return 1;
	}
	cn->v[C_FRAMES] += 1;
	{
		__u64 opcode = le64(fl, 1), length = le64(fl, 4), code = le64(fl, 2) >> 56, ok;

		if (opcode > 1)
			return 0;  /* a notification: no payload */
		cn->v[C_DATA_FRAMES] += 1;
		if (!length)
			return 0;
		ok = (c->codes >> (code & 63)) & 1;
		fl->state = ST_PAYLOAD;
		fl->pay_end = f + length;
		fl->pay_ok = ok;
		fl->origin = opcode == 0 ? f - le64(fl, 5) : f;
		fl->shift = f - fl->elig;
		if (ok) {
			__u32 n = fl->nrec;
			struct krec *r = &fl->rec[n & (NREC - 1)];

			if (n >= NREC)
				fl->horizon = r->e;  /* the oldest record goes: its bytes are stale from now on */
			r->s = f;
			r->e = f + length;
			r->origin = fl->origin;
			r->shift = fl->shift;
			fl->nrec = n + 1;
		}
	}
	return 0;
}

/* Apply flip q (an eligible bit offset of range r) to the packet, with protection and counters. */
static __always_inline void kflip_at(struct __sk_buff *skb, struct kx *x, struct cfg *c, struct krange *r, __u64 q)
{
	__u64 within = q - x->ke, slot, fb;
	__u32 off;
	__u8 mask = 0x80 >> (q & 7), b;

	if (q < x->ke || q >= x->ke_end)
		return;
	if (c->pmask || c->smask || c->emask) {  /* scope tensor: the value grid (element) */
		slot = (((r->s - r->origin) << 3) + within) & (c->vbits - 1) & 63;
		if ((c->pmask >> slot) & 1) {
			__u64 h = q * 0x9e3779b97f4a7c15ULL + x->salt;

			h = mix64(h);
			if ((h >> 11) >= c->resid) {
				if (!r->retx)
					x->f_corr++;
				return;
			}
			if (!r->retx)
				x->f_prot++;
		}
		if (!r->retx) {
			fb = (c->smask >> slot) & 1;
			if (fb)
				x->f_sign++;
			else if ((c->emask >> slot) & 1)
				x->f_exp++;
			else
				x->f_mant++;
		}
	}
	if (r->retx)
		x->retx_flips++;
	else
		x->flips++;
	off = x->pay + (__u32)(r->s - x->off) + (__u32)(within >> 3);
#if defined(TB_FLOOR_COMPUTE)  /* benchmark floor (build.FLOORS): computed and counted, nothing written */
	return;
#elif defined(TB_FLOOR_COPY)  /* benchmark floor: the copy a write needs (tb_keyed's pull), nothing written */
	if (off > x->maxoff)
		x->maxoff = off;
	x->pulled = 1;
	return;
#endif
	if (x->nfo < NFLIP) {  /* written directly by tb_kapply */
		x->fo[x->nfo & (NFLIP - 1)] = (off << 3) | (__u32)(q & 7);
		x->nfo += 1;
		if (off > x->maxoff)
			x->maxoff = off;
		return;
	}
	pull_to(skb, off, &x->pulled, &x->err);  /* not a reallocation per store (a store helper pulls to its byte) */
	if (poke_helpers(skb, off, mask, &b)) {
		x->err = 1;
		return;
	}
	x->applied++;
	x->d_l4 += csum_delta(off, mask, b);
}

static __always_inline void next_block(struct kx *x, __u32 *bm_clear)
{
	*bm_clear = 1;
	x->need = 0;
	x->blk += 1;
	if (x->blk > x->blk_end) {
		x->ri += 1;
		x->started = 0;
	}
}

/* One step of the flip computation over the packet's eligible ranges: one Philox call (a block's count and
 * first two positions, or four more positions) and the flips it yields. Returns 1 when every range is done. */
static long kflips(__u64 i, void *arg)
{
	struct kctx *kc = arg;
	KSTEP_MAPS(kc)
	struct krange *r;
	__u32 w[4], first, clear = 0;

	if (x->ri >= x->nr || x->ri >= NRANGES)
		return 1;
	r = &x->r[x->ri & (NRANGES - 1)];
	if (!x->started) {
		x->ke = (r->s - r->shift) << 3;
		x->ke_end = x->ke + ((r->e - r->s) << 3);
		x->blk = x->ke >> BLOCK_SHIFT;
		x->blk_end = (x->ke_end - 1) >> BLOCK_SHIFT;
		x->started = 1;
		x->need = 0;
	}
	if (x->need == 0) {
		__u64 u, cnt = 0, nt = c->ntail;

		philox(w, x->blk, 0, 0, x->k0, x->k1);
		u = ((__u64)w[1] << 32) | w[0];
		for (int k = 0; k < MAXTAIL; k++) {
			if (k >= nt || u >= c->tail[k])
				break;
			cnt++;
		}
		if (!cnt) {
			next_block(x, &clear);
			return 0;
		}
		x->need = cnt;
		x->npos = 0;
		x->wj = 0;
		first = 2;
	} else {
		x->wj += 1;
		if (x->wj > MAX_WORDS_J) {  /* cannot happen with a table of MAXTAIL: a block left incomplete */
			x->err = 1;
			next_block(x, &clear);
			goto cleanup;
		}
		philox(w, x->blk, x->wj, 0, x->k0, x->k1);
		first = 0;
	}
#pragma clang loop unroll(full)
	for (int j = 0; j < 4; j++) {
		__u32 p, n;

		if (j < first || !x->need)
			continue;
		p = w[j] & 4095;
		if ((x->bm[(p >> 6) & 63] >> (p & 63)) & 1)
			continue;  /* a repeat: skipped (the positions are a uniform subset) */
		x->bm[(p >> 6) & 63] |= 1ULL << (p & 63);
		n = x->npos;
		x->pos[n & (MAXTAIL - 1)] = p;
		x->npos = n + 1;
		x->need -= 1;
		kflip_at(kc->skb, x, c, r, (x->blk << BLOCK_SHIFT) + p);
	}
	if (!x->need)
		next_block(x, &clear);
cleanup:
	if (clear) {
		for (int j = 0; j < MAXTAIL; j++) {
			__u32 p;

			if (j >= x->npos)
				break;
			p = x->pos[j & (MAXTAIL - 1)];
			x->bm[(p >> 6) & 63] = 0;
		}
		x->npos = 0;
	}
	return 0;
}

/* A new configuration in keyed mode: the slot switches at once (nothing of a stream to keep); the epoch log
 * records where the eligible bits and flips stood. */
static __always_inline void keyed_cfg(struct state *st, struct cfg *c, __u64 ver)
{
	__u64 now = bpf_ktime_get_boot_ns(), n;
	struct epoch *ep;

	bpf_spin_lock(&st->lock);
	if (st->applied != ver) {
		st->applied = ver;
		st->slot = ver & (NSLOTS - 1);
		n = st->nepochs;
		if (!n || c->new_epoch) {
			ep = &st->epochs[n & (NEPOCHS - 1)];
			ep->version = ver;
			ep->ber_bits = c->ber_bits;
			ep->start_bits = st->gen_pos + st->kbits;
			ep->start_flips = st->gen_idx + st->kflips;
			ep->ktime = now;
			st->nepochs = n + 1;
		}
	}
	bpf_spin_unlock(&st->lock);
}

/* A keyed packet's end: errors, modified-packet counters, the L4 checksum (a complete one updated; a
 * CHECKSUM_PARTIAL one is left: completed over the corrupted bytes, or never checked). */
static __always_inline void kfinish(struct __sk_buff *skb, struct kx *x, struct counters *cn)
{
	if (x->err)
		cn->v[C_ERRORS] += 1;
	if (!x->applied)
		return;
	cn->v[C_MODIFIED] += 1;
	if (x->applied > 1)
		cn->v[C_MULTIFLIP] += 1;
	cn->v[C_FLIPS_APPLIED] += x->applied;
	if (skb->gso_size)
		cn->v[C_GSO_FLIPS] += x->flips;
	{
		__u64 f = x->udp ? BPF_F_MARK_MANGLED_0 : 0, d = fold(x->d_l4);

		if (d && d != 0xffff)
			bpf_l4_csum_replace(skb, x->csum_off, 0, (__u32)d, f);
	}
}

SEC("tc")
int tb_keyed(struct __sk_buff *skb)
{
	__u32 zero = 0;
	struct config *cf = bpf_map_lookup_elem(&tb_config, &zero);
	struct state *st = bpf_map_lookup_elem(&tb_state, &zero);
	struct counters *cn = bpf_map_lookup_elem(&tb_counters, &zero);
	struct kx *x = bpf_map_lookup_elem(&tb_kscratch, &zero);
	struct kflow *fl;
	struct cfg *c;
	__u64 top0, end;
	__s64 off;

	if (!cf || !st || !cn || !x)
		return TC_ACT_OK;
	c = &cf->slot[x->ver & (NSLOTS - 1)];
	if (READ_ONCE(st->applied) != x->ver)
		keyed_cfg(st, c, x->ver);
	x->nr = 0;
	x->ri = 0;
	x->started = 0;
	x->need = 0;
	x->npos = 0;
	x->err = 0;
	x->pulled = 0;
	x->nfo = 0;
	x->maxoff = 0;
	x->d_l4 = x->flips = x->retx_flips = x->applied = x->newbits = 0;
	x->f_prot = x->f_corr = x->f_sign = x->f_exp = x->f_mant = 0;
	if (x->udp) {  /* the direction's packet-order stream under the link key (the NFQUEUE engine's link model) */
		if (c->scope == SCOPE_TENSOR || !x->plen)
			return TC_ACT_OK;
		x->k0 = (__u32)c->lk[0];
		x->k1 = (__u32)c->lk[1];
		x->salt = 0;
		off = __sync_fetch_and_add(&st->ucursor, (__u64)x->plen << 3) >> 3;
		x->off = off;
		add_range(x, cn, off, off + x->plen, off, 0, 0);
		goto flip;
	}
	fl = bpf_map_lookup_elem(&tb_kflows, &x->k);
	if (!fl) {
		bpf_map_update_elem(&tb_kflows, &x->k, &x->blank, BPF_NOEXIST);
		fl = bpf_map_lookup_elem(&tb_kflows, &x->k);
		if (!fl) {
			cn->v[C_KFLOWS_LOST] += 1;
			return TC_ACT_OK;
		}
	}
	{
		__u32 seq = x->seq, fg = x->tflags;

		if (fg & 0x02) {  /* SYN (or SYN-ACK): a new stream after it */
			__u32 isn = seq + 1;

			if ((fl->flags & KF_BASE) && fl->base != isn) {  /* a new connection on the 4-tuple */
				release_ordinal(&x->k, fl);
				__builtin_memset(fl, 0, sizeof(*fl));
			}
			if (!(fl->flags & KF_BASE)) {
				fl->base = isn;
				fl->flags = KF_BASE | KF_SYN | KF_ORD | ((fg & 0x10) ? 0 : KF_INIT);
				fl->ordinal = take_ordinal(&x->k);
				fl->state = (fl->flags & KF_INIT) ? ST_HANDSHAKE : ST_HEADER;
				fl->need = (fl->flags & KF_INIT) ? 8 : 48;
			}
			seq = isn;
		} else if (!(fl->flags & KF_BASE)) {
			fl->base = seq;
			fl->flags |= KF_BASE;
		}
		if (fg & 0x05) {  /* FIN or RST: its ordinal is free for the next connection */
			fl->flags |= KF_CLOSED;
			release_ordinal(&x->k, fl);
		}
		if (!x->plen)
			return TC_ACT_OK;
		{  /* flows.unwrap_offset against the highest offset seen */
			__s32 d = (__s32)(seq - fl->base - (__u32)fl->top);

			off = (__s64)fl->top + d;
		}
	}
	top0 = fl->top;
	end = off + x->plen;
	if ((__s64)end > (__s64)fl->top)
		fl->top = end;
	x->off = off;
	if (fl->flags & KF_SYN) {  /* identity: ordinal, the two addresses, port pair 0 */
		__u32 wd[4];
		__u64 sa = bpf_ntohl(x->k.saddr), da = bpf_ntohl(x->k.daddr), xs;

		philox(wd, (sa << 32) | fl->ordinal, da, 0, (__u32)c->fk[0], (__u32)c->fk[1]);
		x->k0 = wd[0];
		x->k1 = wd[1];
		xs = mix64p(c->salt_seed);
		xs = mix64p(xs ^ fl->ordinal);
		x->salt = mix64p(xs ^ ((sa << 32) | da));
	} else {  /* first seen mid-stream: connection 0, the 4-tuple */
		__u32 wd[4];
		__u64 sa = bpf_ntohl(x->k.saddr), da = bpf_ntohl(x->k.daddr);
		__u32 pt = ((__u32)x->k.sport << 16) | x->k.dport;

		if (c->scope == SCOPE_TENSOR) {  /* its framing is unknown: never corrupted */
			if (!(fl->flags & KF_MID_COUNTED)) {
				fl->flags |= KF_MID_COUNTED;
				cn->v[C_MIDSTREAM] += 1;
			}
			return TC_ACT_OK;
		}
		philox(wd, sa << 32, da, pt, (__u32)c->fk[0], (__u32)c->fk[1]);
		x->k0 = wd[0];
		x->k1 = wd[1];
		x->salt = 0;
	}
	if (c->scope == SCOPE_TENSOR) {
		__u64 f = fl->frontier;

		if (fl->flags & KF_DESYNC)
			return TC_ACT_OK;
		if ((__s64)off < 0)
			return TC_ACT_OK;
		if (off < f)  /* (partly) sent before: the record answers */
			lookup(x, fl, cn, off, end < f ? end : f);
		if (end > f) {
			if (off > f) {  /* beyond a gap (reordered on the way to an ingress hook, or its first copy lost) */
				if (fl->state != ST_PAYLOAD || end > fl->pay_end || fl->hole_hi) {
					/* across a header: cannot be parsed here; fail closed for good */
					fl->flags |= KF_DESYNC;
					cn->v[C_DESYNCED] += 1;
					cn->v[C_DESYNC_OOO] += 1;
					return TC_ACT_OK;
				}
				/* inside the current frame's payload: its bytes are known without the gap's, and so are the
				 * gap's (the record answers them when they come, as new bytes: the hole) */
				if (fl->pay_ok) {
					add_range(x, cn, off, end, fl->origin, fl->shift, 0);
					fl->elig += end - f;
				}
				fl->hole_lo = f;
				fl->hole_hi = off;
				fl->frontier = end;
				cn->v[C_KHOLES] += 1;
				if (end == fl->pay_end) {
					fl->state = ST_HEADER;
					fl->need = 48;
				}
			} else {
				x->pp = (__u32)(f - off);
				struct kctx kc = {.skb = skb};

				bpf_loop(4096, kparse, &kc, 0);
			}
		}
	} else {  /* payload: the stream offset is the counter; bytes below the highest seen are sent again */
		__u64 s = (__s64)off < 0 ? 0 : off;

		if ((__s64)end <= 0)
			return TC_ACT_OK;
		if (s < top0) {
			__u64 e1 = end < top0 ? end : top0;

			add_range(x, cn, s, e1, s, 0, 1);
			s = e1;
		}
		if (s < end)
			add_range(x, cn, s, end, s, 0, 0);
	}
flip:
	if (!x->nr)
		return TC_ACT_OK;
	if (c->ntail) {
		struct kctx kc = {.skb = skb};

		bpf_loop(1 << 20, kflips, &kc, 0);
	}
	for (int j = 0; j < NRANGES; j++) {  /* bits seen, sent again, protected (BitLayout.protected_bits) */
		struct krange *r = &x->r[j & (NRANGES - 1)];
		__u64 nb, g, full, rem, vb = c->vbits & 63, pm = c->pmask, m2;

		if (j >= x->nr)
			break;
		nb = (r->e - r->s) << 3;
		if (r->retx) {
			cn->v[C_RETX_BITS] += nb;
			continue;
		}
		x->newbits += nb;
		if (pm && vb) {
			g = ((r->s - r->origin) << 3) & (vb - 1);
			full = nb / vb;
			rem = nb - full * vb;
			m2 = (pm | (pm << vb)) >> g;
			m2 &= rem >= 64 ? ~0ULL : ((1ULL << rem) - 1);
			cn->v[C_BITS_PROTECTED] += full * __builtin_popcountll(pm) + __builtin_popcountll(m2);
		}
	}
	__sync_fetch_and_add(&st->kbits, x->newbits);
	if (x->flips)
		__sync_fetch_and_add(&st->kflips, x->flips);
	cn->v[C_RETX_FLIPS] += x->retx_flips;
	cn->v[C_FLIPS_PROTECTED] += x->f_prot;
	cn->v[C_FLIPS_CORRECTED] += x->f_corr;
	cn->v[C_FLIPS_SIGN] += x->f_sign;
	cn->v[C_FLIPS_EXPONENT] += x->f_exp;
	cn->v[C_FLIPS_MANTISSA] += x->f_mant;
#ifdef TB_FLOOR_COPY
	if (x->pulled && bpf_skb_pull_data(skb, x->maxoff + 1 < skb->len ? x->maxoff + 1 : skb->len))
		cn->v[C_ERRORS] += 1;
#endif
	if (x->nfo) {
		/* linear and private up to the last flip (one copy), then the direct writes of tb_kapply, whose
		 * verifier-made unclone prologue then has nothing to do (tb_flip's reasoning) */
		__u32 n = x->maxoff + 1;

		if (n > skb->len)
			n = skb->len;
		if (bpf_skb_pull_data(skb, n)) {
			cn->v[C_UNCLONE_FAILED] += 1;
			cn->v[C_ERRORS] += 1;
			return TC_ACT_OK;
		}
		bpf_tail_call(skb, &tb_progs, 2);
		cn->v[C_ERRORS] += 1;  /* the applier is missing: flips counted, not applied */
		return TC_ACT_OK;
	}
	kfinish(skb, x, cn);
	return TC_ACT_OK;
}

/* One of the packet's listed flips, written directly (the packet is linear and private up to the last one). */
static long kapply_step(__u64 i, void *arg)
{
	struct kctx *kc = arg;
	struct __sk_buff *skb = kc->skb;
	__u32 zero = 0, v, off;
	struct kx *x = bpf_map_lookup_elem(&tb_kscratch, &zero);
	__u8 mask, b;

	if (!x || i >= x->nfo || i >= NFLIP)
		return 1;
	v = x->fo[i & (NFLIP - 1)];
	off = v >> 3;
	mask = 0x80 >> (v & 7);
	if (poke(skb, off, mask, &b)) {
		x->err = 1;
		return 0;
	}
	x->applied++;
	x->d_l4 += csum_delta(off, mask, b);
	return 0;
}

/* The direct writes of tb_keyed's listed flips, then the checksum and the packet's counters. */
SEC("tc")
int tb_kapply(struct __sk_buff *skb)
{
	__u32 zero = 0;
	struct counters *cn = bpf_map_lookup_elem(&tb_counters, &zero);
	struct kx *x = bpf_map_lookup_elem(&tb_kscratch, &zero);
	struct kctx kc = {.skb = skb};

	if (!cn || !x)
		return TC_ACT_OK;
	bpf_loop(NFLIP, kapply_step, &kc, 0);
	kfinish(skb, x, cn);
	return TC_ACT_OK;
}

SEC("tc")
int tb_flip(struct __sk_buff *skb)
{
	__u32 zero = 0;
	struct config *cf = bpf_map_lookup_elem(&tb_config, &zero);
	struct state *st = bpf_map_lookup_elem(&tb_state, &zero);
	struct counters *cn = bpf_map_lookup_elem(&tb_counters, &zero);
	struct cfg *c;
	__u64 ver, now = 0, s, e, nbits, idx0, nf;
	__u32 l3 = ETH_HLEN, n, ihl, total, l4h, start, stop, csum_off, skip = 0, excluded = 0;
	__u32 keep_len = 0xffffffff;  /* eligible payload bytes from `skip` on (all: no sequence tracking) */
	__u8 h[20], t[20], proto;
	int fast, sure, udp;

	if (!cf || !st || !cn)
		return TC_ACT_OK;
	ver = READ_ONCE(cf->version);
	if (!ver)
		return TC_ACT_OK;  /* not configured yet: passes, like a link before its NFQUEUE rule */
	if (skb->protocol != bpf_htons(ETH_P_IP))
		return TC_ACT_OK;  /* the NFQUEUE engine's iptables rule never sees non-IPv4 frames either */
	c = &cf->slot[ver & (NSLOTS - 1)];
	cn->v[C_PACKETS] += 1;
	if (skb->len < l3)
		return unparsed(cn, C_U_SHORT);
	n = skb->len - l3;
	cn->v[C_BYTES] += n;
	if (skb->gso_size)
		cn->v[C_GSO] += 1;

	/* parse as testbed/engine/packet.py parse_ipv4 does */
	if (n < 20 || bpf_skb_load_bytes(skb, l3, h, 20))
		return unparsed(cn, C_U_SHORT);
	if ((h[0] >> 4) != 4)
		return unparsed(cn, C_U_NOT_IPV4);
	ihl = (h[0] & 0x0f) << 2;
	if (ihl < 20 || ihl > n)
		return unparsed(cn, C_U_BAD_IHL);
	total = ((__u32)h[2] << 8) | h[3];
	if (total < ihl || total > n)
		return unparsed(cn, C_U_BAD_LENGTH);
	if ((h[6] & 0x3f) || h[7])
		return unparsed(cn, C_U_FRAGMENT);
	proto = h[9];
	if (proto == 6) {
		if (total - ihl < 20 || bpf_skb_load_bytes(skb, l3 + ihl, t, 20))
			return unparsed(cn, C_U_BAD_L4);
		l4h = (t[12] >> 4) << 2;
		if (l4h < 20 || ihl + l4h > total)
			return unparsed(cn, C_U_BAD_L4);
		csum_off = l3 + ihl + 16;
		udp = 0;
	} else if (proto == 17) {
		if (total - ihl < 8 || bpf_skb_load_bytes(skb, l3 + ihl, t, 8))
			return unparsed(cn, C_U_BAD_L4);
		if ((((__u32)t[4] << 8) | t[5]) != total - ihl)
			return unparsed(cn, C_U_BAD_L4);
		l4h = 8;
		csum_off = l3 + ihl + 6;
		udp = 1;
	} else {
		return unparsed(cn, C_U_NOT_TCP_UDP);
	}

	/* flows: control ports are never corrupted; TCP payload sent before passes clean (payload + fix) */
	{
		struct flow_key k = {};
		struct flow *fl;
		__u16 sport = ((__u16)t[0] << 8) | t[1], dport = ((__u16)t[2] << 8) | t[3];
		__u64 np = c->nports;

		__builtin_memcpy(&k.saddr, &h[12], 4);
		__builtin_memcpy(&k.daddr, &h[16], 4);
		k.sport = sport;
		k.dport = dport;
		k.proto = proto;
		for (int i = 0; i < NPORTS; i++) {
			if (i >= np)
				break;
			if (c->ports[i] == sport || c->ports[i] == dport)
				excluded = 1;
		}
		fl = bpf_map_lookup_elem(&tb_flows, &k);
		if (!fl) {
			struct flow nf = {};

			if (!bpf_map_update_elem(&tb_flows, &k, &nf, BPF_NOEXIST))
				cn->v[C_FLOWS] += 1;
			fl = bpf_map_lookup_elem(&tb_flows, &k);
		}
		if (excluded) {
			if (fl && !(fl->flags & F_EXCLUDED_COUNTED)) {
				fl->flags |= F_EXCLUDED_COUNTED;
				cn->v[C_FLOWS_EXCLUDED] += 1;
			}
			return TC_ACT_OK;
		}
		if (c->keyed) {  /* flips as a pure function of position: tb_keyed */
			struct kx *x = bpf_map_lookup_elem(&tb_kscratch, &zero);

			if (!x) {
				cn->v[C_ERRORS] += 1;
				return TC_ACT_OK;
			}
			x->k = k;
			x->l3 = l3;
			x->l4 = l3 + ihl;
			x->pay = l3 + ihl + l4h;
			x->plen = total - ihl - l4h;
			x->csum_off = csum_off;
			x->udp = udp;
			x->seq = ((__u32)t[4] << 24) | ((__u32)t[5] << 16) | ((__u32)t[6] << 8) | t[7];
			x->tflags = udp ? 0 : t[13];
			x->ver = ver;
			bpf_tail_call(skb, &tb_progs, 1);
			cn->v[C_ERRORS] += 1;
			return TC_ACT_OK;
		}
		if (fl && !udp && c->skip_retx && c->scope == SCOPE_PAYLOAD) {
			__u32 seq = ((__u32)t[4] << 24) | ((__u32)t[5] << 16) | ((__u32)t[6] << 8) | t[7];
			__u32 plen = total - ihl - l4h;

			keep_len = plen;
			if (t[13] & 0x02) {  /* SYN: a new connection; its data starts after the SYN */
				fl->next_seq = seq + plen + 1;
				fl->flags |= F_SEQ;
				fl->nholes = 0;
			} else if (!(fl->flags & F_SEQ)) {  /* first seen mid-stream: counts from here */
				fl->next_seq = seq + plen;
				fl->flags |= F_SEQ;
			} else if (plen) {
				new_range(fl, cn, seq, plen, &skip, &keep_len);
			}
			if (plen - keep_len)
				cn->v[C_RETX_BITS] += (__u64)(plen - keep_len) << 3;
		}
	}

	if (c->scope == SCOPE_ALL) {
		start = l3;
		stop = l3 + total;
	} else {
		start = l3 + ihl + l4h + skip;
		stop = l3 + total;
		if (keep_len < stop - start)
			stop = start + keep_len;
	}
	if (start >= stop)
		return TC_ACT_OK;
	if (c->checksum == CSUM_KEEP && skb->gso_size && !(c->t[T_GOOD_FLIP].never && c->t[T_BAD_FLIP].never)) {
		/* a GSO (or GRO) packet cannot be made to fail its checksum per segment: keep needs MTU frames (the
		 * sender's offload is off while a flip is possible; at BER 0 it stays on and super-packets count) */
		cn->v[C_KEEP_GSO_PASSED] += 1;
		return TC_ACT_OK;
	}
	nbits = (__u64)(stop - start) << 3;

	/* reserve [s, e) of the stream */
	if (READ_ONCE(st->applied) != ver)
		now = bpf_ktime_get_boot_ns();
	bpf_spin_lock(&st->lock);
	if (st->applied != ver && st->gen_pos == st->cursor)
		apply_cfg(st, c, ver, now);
	s = st->cursor;
	e = s + nbits;
	st->cursor = e;
	idx0 = st->gen_idx;
	fast = st->gen_pos == s && st->next_flip >= e && st->soj_end >= e;
	if (fast)
		st->gen_pos = e;
	/* a flip certainly falls in this packet (the stream is drawn up to it and the next flip is inside) */
	nf = st->next_flip;
	sure = st->gen_pos == s && nf < e && nf < st->soj_end;
	bpf_spin_unlock(&st->lock);
	if (skb->gso_size)
		cn->v[C_GSO_BITS] += nbits;
	if (fast)
		return TC_ACT_OK;  /* no flip in this packet: the common case */

	{
		struct pctx *x = bpf_map_lookup_elem(&tb_scratch, &zero);

		if (!x) {
			cn->v[C_ERRORS] += 1;
			return TC_ACT_OK;
		}
		__builtin_memset(x, 0, sizeof(*x));
		x->s = s;
		x->e = e;
		x->idx = idx0;
		x->base = start;
		x->l3 = l3;
		x->l4 = l3 + ihl;
		x->csum_off = csum_off;
		x->end = stop;
		x->fix_all = c->checksum == CSUM_FIX && c->scope == SCOPE_ALL;
		x->udp = udp;
		x->keep = c->checksum == CSUM_KEEP;
		x->gso = skb->gso_size != 0;
		/* Private (and linear up to the first flip) before the applier runs, so that its unclone prologue
		 * has nothing to do. Only where a flip is sure: another packet's flips in flight make it unsure, and
		 * the applier pulls at its first flip then. */
		if (sure) {
			__u32 n = start + (__u32)((nf - s) >> 3) + 1;

			if (n > skb->len)
				n = skb->len;
			x->pulled = 1;
			if (bpf_skb_pull_data(skb, n))
				x->err = 1;
		}
		/* The applier's verifier-made prologue unclones a cloned skb and, where that fails (-ENOMEM), DROPS
		 * it (TC_ACT_SHOT): a packet lost after its bits were drawn, silently (TCP retransmits it; the copy
		 * passes clean, so the application sees fewer errors than counted, and the last packet of a transfer
		 * is never counted). Unclone here instead, where a failure can pass the packet and count it: after a
		 * successful pull the prologue finds the skb private (or finds the same answer without allocating). */
		if (bpf_skb_pull_data(skb, 0)) {
			cn->v[C_UNCLONE_FAILED] += 1;
			cn->v[C_ERRORS] += 1;
			return TC_ACT_OK;
		}
		bpf_tail_call(skb, &tb_progs, 0);
		/* not reached unless the applier is missing: its flips are drawn and counted, not applied */
		cn->v[C_ERRORS] += 1;
	}
	return TC_ACT_OK;
}

/* The rest of a packet that the stream may flip: the bpf_loop of steps, then checksums and counters. */
SEC("tc")
int tb_apply(struct __sk_buff *skb)
{
	__u32 zero = 0;
	struct counters *cn = bpf_map_lookup_elem(&tb_counters, &zero);
	struct pctx *x = bpf_map_lookup_elem(&tb_scratch, &zero);
	struct lctx lc = {.skb = skb};
	__u32 l3, csum_off;

	if (!cn || !x)
		return TC_ACT_OK;
	if (bpf_loop(MAX_STEPS, step, &lc, 0) >= MAX_STEPS)
		x->err = 1;  /* not finished: flips counted but not applied (needs > 4 Mi events in a packet) */
	if (x->err)
		cn->v[C_ERRORS] += 1;
	if (x->overrun)
		cn->v[C_OVERRUNS] += 1;
	cn->v[C_SHARED] += x->shared;
	if (!x->flips)
		return TC_ACT_OK;
	cn->v[C_MODIFIED] += 1;
	if (x->gso)
		cn->v[C_GSO_FLIPS] += x->flips;
	if (x->flips > 1)
		cn->v[C_MULTIFLIP] += 1;
	cn->v[C_FLIPS_APPLIED] += x->applied;
	cn->v[C_FLIPS_ON_CSUM] += x->on_csum;
	l3 = x->l3;
	csum_off = x->csum_off;
	if (!x->keep) {
		__u64 f = x->udp ? BPF_F_MARK_MANGLED_0 : 0, d;

		/* A CHECKSUM_PARTIAL skb (locally sent, offloaded) holds the pseudo-header sum: the helper
		 * leaves it alone for payload changes (the checksum is completed over the corrupted bytes,
		 * or never checked); a complete checksum is updated. */
		d = fold(x->d_l4);
		if (d && d != 0xffff)
			bpf_l4_csum_replace(skb, csum_off, 0, (__u32)d, f);
		d = fold(x->d_ps);
		if (d && d != 0xffff)
			bpf_l4_csum_replace(skb, csum_off, 0, (__u32)d, f | BPF_F_PSEUDO_HDR);
		if (x->iphdr) {  /* recompute the IPv4 header checksum as the (corrupted) header describes it */
			__u8 ip[60] = {};
			__u8 b0;
			__u32 hl;
			__u16 sum;

			if (!bpf_skb_load_bytes(skb, l3, &b0, 1)) {
				hl = (b0 & 0x0f) << 2;
				if (hl >= 20 && hl <= 60 && l3 + hl <= skb->len &&
				    !bpf_skb_load_bytes(skb, l3, ip, hl)) {
					ip[10] = 0;
					ip[11] = 0;
					sum = ~(__u16)fold((__u32)bpf_csum_diff(0, 0, (void *)ip, hl, 0));
					bpf_skb_store_bytes(skb, l3 + 10, &sum, 2, 0);
				}
			}
		}
	} else {
		/* keep: the sender's checksum stays; make the stack verify it (CHECKSUM_UNNECESSARY -> NONE) */
		bpf_csum_level(skb, BPF_CSUM_LEVEL_RESET);
	}
	return TC_ACT_OK;
}

char LICENSE[] SEC("license") = "Apache-2.0";
