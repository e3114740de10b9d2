//! Who the members of the job are, and which of them owns a file.
//!
//! Membership comes from the launcher (`[cluster]` in the configuration, see `cluster/config.rs`):
//! every agent of a job reads the same list, so they all agree on it without a consensus of our own.
//!
//! A file's owner is chosen by rendezvous (highest random weight) hashing: every member gets a weight
//! from the hash of the file's key and the member's name, and the heaviest live member owns the file.
//! No network hop finds it; a member that goes down hands on only the files it owned, each to the next
//! heaviest member. To keep a lookup cheap at a thousand nodes, members are leaves of a fixed tree of
//! fan-out [`FANOUT`] (the skeleton variant of rendezvous hashing): a lookup picks the heaviest child at
//! each level, so it weighs about `FANOUT * log_FANOUT(N)` candidates instead of N. The tree is built
//! from the sorted member list, so every agent builds the same one.

use std::collections::BTreeSet;

/// Children per node of the skeleton tree.
pub const FANOUT: usize = 8;

/// A 64-bit mix (splitmix64's finalizer): spreads a combined key and member hash into a weight.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The 64-bit hash of a name or key.
pub fn hash64(bytes: &[u8]) -> u64 {
    u64::from_le_bytes(blake3::hash(bytes).as_bytes()[..8].try_into().expect("8 bytes"))
}

/// One node of the skeleton tree: a member (leaf) or a group of children.
#[derive(Debug)]
enum Node {
    Leaf { member: usize, id: u64 },
    Group { id: u64, children: Vec<Node>, members: usize },
}

impl Node {
    fn id(&self) -> u64 {
        match self {
            Node::Leaf { id, .. } | Node::Group { id, .. } => *id,
        }
    }

    fn members(&self) -> usize {
        match self {
            Node::Leaf { .. } => 1,
            Node::Group { members, .. } => *members,
        }
    }

    /// This child's score for key hash `k`: weighted rendezvous (`w / -ln u`), so that a group is chosen
    /// in proportion to its members and every member, whatever group it sits in, owns an equal share.
    fn score(&self, k: u64) -> f64 {
        let u = ((mix(k ^ self.id()) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        self.members() as f64 / -u.ln()
    }
}

/// The owners of files among a fixed list of members, some of which may be down.
#[derive(Debug)]
pub struct Owners {
    names: Vec<String>,
    root: Node,
}

impl Owners {
    /// The rendezvous tree of `members` (names; order does not matter, duplicates are one member).
    pub fn new(members: &[String]) -> Owners {
        let names: Vec<String> = members.iter().cloned().collect::<BTreeSet<_>>().into_iter().collect();
        let mut level: Vec<Node> =
            names.iter().enumerate().map(|(i, n)| Node::Leaf { member: i, id: hash64(n.as_bytes()) }).collect();
        let mut depth = 0u64;
        while level.len() > 1 {
            depth += 1;
            let mut next = Vec::new();
            let mut it = level.into_iter().peekable();
            let mut g = 0u64;
            while it.peek().is_some() {
                let children: Vec<Node> = it.by_ref().take(FANOUT).collect();
                let members = children.iter().map(Node::members).sum();
                // A group's id names its place in the tree, so every agent computes the same weights.
                next.push(Node::Group { id: mix(depth << 32 | g), children, members });
                g += 1;
            }
            level = next;
        }
        let root = level.pop().unwrap_or(Node::Group { id: 0, children: Vec::new(), members: 0 });
        Owners { names, root }
    }

    /// The members, sorted.
    pub fn members(&self) -> &[String] {
        &self.names
    }

    /// The member (index into [`Owners::members`]) that owns `key` among those `up` says are live, or
    /// `None` when none is.
    pub fn owner(&self, key: &[u8], up: impl Fn(usize) -> bool) -> Option<usize> {
        let k = hash64(key);
        Self::pick(&self.root, k, &up)
    }

    /// The heaviest live leaf under `node`: children by descending weight, the first with a live leaf.
    fn pick(node: &Node, k: u64, up: &impl Fn(usize) -> bool) -> Option<usize> {
        match node {
            Node::Leaf { member, .. } => up(*member).then_some(*member),
            Node::Group { children, .. } => {
                let mut order = [(0f64, 0usize); FANOUT];
                for (i, c) in children.iter().enumerate() {
                    order[i] = (c.score(k), i);
                }
                let order = &mut order[..children.len()];
                order.sort_unstable_by(|a, b| b.0.total_cmp(&a.0));
                order.iter().find_map(|&(_, i)| Self::pick(&children[i], k, up))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("node{i:04}")).collect()
    }

    #[test]
    fn owners_are_the_same_whatever_the_order_of_the_list() {
        let a = Owners::new(&names(100));
        let mut shuffled = names(100);
        shuffled.reverse();
        let b = Owners::new(&shuffled);
        for i in 0..1000 {
            let key = format!("train/{i}.jpg");
            assert_eq!(a.owner(key.as_bytes(), |_| true), b.owner(key.as_bytes(), |_| true));
        }
    }

    #[test]
    fn a_member_going_down_moves_only_its_own_files() {
        let o = Owners::new(&names(200));
        let down = 17;
        let mut moved = 0;
        for i in 0..20_000 {
            let key = format!("f{i}");
            let before = o.owner(key.as_bytes(), |_| true).unwrap();
            let after = o.owner(key.as_bytes(), |m| m != down).unwrap();
            if before == down {
                assert_ne!(after, down);
                moved += 1;
            } else {
                assert_eq!(before, after, "a file of a live member moved");
            }
        }
        assert!((50..150).contains(&moved), "member 17 owned {moved} of 20000 files (expected ~100)");
        assert_eq!(o.owner(b"x", |_| false), None);
    }

    #[test]
    fn files_spread_evenly_over_a_thousand_members() {
        let o = Owners::new(&names(1000));
        let mut count = vec![0u32; 1000];
        let n = 400_000;
        for i in 0..n {
            count[o.owner(format!("data/{i}").as_bytes(), |_| true).unwrap()] += 1;
        }
        let mean = n as f64 / 1000.0;
        let max = *count.iter().max().unwrap() as f64;
        // Binomial noise alone at 400 files a member is about 5%; the tree must add little to it.
        assert!(max / mean < 1.25, "busiest member has {max} files, mean {mean}");
    }
}
