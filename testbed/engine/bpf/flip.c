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

#define T_GOOD_FLIP 0
#define T_BAD_FLIP 1
#define T_GOOD_LEN 2
#define T_BAD_LEN 3

#define SCOPE_PAYLOAD 0
#define SCOPE_ALL 1
#define CSUM_FIX 0
#define CSUM_KEEP 1

/* counters (per CPU; userspace sums them) */
enum {
	C_PACKETS, C_BYTES, C_MODIFIED, C_MULTIFLIP, C_UNPARSED,
	C_U_SHORT, C_U_NOT_IPV4, C_U_BAD_IHL, C_U_BAD_LENGTH, C_U_FRAGMENT, C_U_NOT_TCP_UDP, C_U_BAD_L4,
	C_ERRORS, C_RETX_BITS, C_FLOWS, C_FLOWS_EXCLUDED, C_GSO, C_KEEP_GSO_PASSED, C_OVERRUNS,
	C_FLIPS_ON_CSUM, C_FLIPS_APPLIED, C_SHARED, C_GSO_BITS, C_GSO_FLIPS, C_UNCLONE_FAILED, C_HOLE_BITS,
	C_HOLES_LOST, C_N
};
#define NCOUNTERS 32

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

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct config);
} tb_config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct state);
} tb_state SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct ring);
} tb_ring SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct counters);
} tb_counters SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct pctx);
} tb_scratch SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct flow_key);
	__type(value, struct flow);
} tb_flows SEC(".maps");

/* The flip applier, a second program reached by a tail call only for packets whose bits hold flips. It writes the
 * flipped bytes directly into the packet; a program that writes packet data directly gets a prologue from the
 * verifier that unclones every cloned skb it runs on (TCP's are: the original stays in the retransmission
 * queue), so the writes live there and not in tb_flip, which every packet runs. */
int tb_apply(struct __sk_buff *skb);

struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, 1);
	__uint(key_size, sizeof(__u32));
	__array(values, int (void *));
} tb_progs SEC(".maps") = {
	.values = { [0] = (void *)&tb_apply },
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

static __always_inline void flip_one(struct __sk_buff *skb, struct pctx *x, __u64 q)
{
	__u32 off = x->base + (__u32)(q >> 3);
	__u8 mask = 0x80 >> (q & 7), b;
	__u64 m, dd;

	x->flips++;
	if (x->fix_all && ((off >= x->l3 + 10 && off < x->l3 + 12) ||
			   (x->csum_off && off >= x->csum_off && off < x->csum_off + 2))) {
		x->on_csum++;  /* the checksum is made valid anyway (as the NFQUEUE engine overwrites it) */
		return;
	}
	if (beyond_linear(skb, off)) {
		/* Beyond the linear part: make it linear (and private) up to this byte the first time, all of it the
		 * second. The pull copies what it makes linear, so a packet with one flip (most at low BERs) copies
		 * half of itself on average, not all; a packet with many flips pays one small extra copy. */
		__u32 n = x->pulled ? skb->len : off + 1;

		x->pulled++;
		if (bpf_skb_pull_data(skb, n))
			x->err = 1;
	}
	{
		/* direct packet access: the linear part is private after a pull (tb_apply's prologue uncloned the skb,
		 * if tb_flip had not pulled already) */
		__u8 *data = (__u8 *)(long)skb->data, *dend = (__u8 *)(long)skb->data_end, *p;
		__u32 o = off & 0xffff;

		/* the verifier sets a packet range only for offsets + size <= 0xffff: the last bytes of a 64 KB
		 * packet take the helpers */
		p = data + o;
		if (o == off && o < 0xffff && p + 1 <= dend) {
			b = *p;
			*p = b ^ mask;
		} else {
			if (bpf_skb_load_bytes(skb, off, &b, 1)) {
				x->err = 1;
				return;
			}
			b ^= mask;
			if (bpf_skb_store_bytes(skb, off, &b, 1, 0)) {
				x->err = 1;
				return;
			}
			b ^= mask;
		}
	}
	/* 16-bit words as the kernel sums them (little-endian loads): an even offset is the low byte; b is the
	 * byte before the flip */
	m = (off & 1) ? ((__u64)mask << 8) : mask;
	dd = (b & mask) ? (0xffff ^ m) : m;
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
