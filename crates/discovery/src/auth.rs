//! Mutual authentication of store clients and servers by challenge–response: each side sends
//! a random nonce and proves it knows the job token with an HMAC-SHA256 of both nonces, keyed
//! by the token. The token itself never crosses the wire, a server of another job (or anything
//! that listens on the port first) cannot pass as this job's store, and a recorded exchange is
//! useless later (fresh nonces every time).

use hmac::{Hmac, Mac};
use sha2::Sha256;

use comm_core::CommError;

/// Bytes of a nonce and of a proof.
pub(crate) const NONCE: usize = 32;
pub(crate) const PROOF: usize = 32;

/// Who proves: the two directions use different labels, so a proof cannot be reflected back.
#[derive(Clone, Copy)]
pub(crate) enum Role {
    Server,
    Client,
}

pub(crate) fn nonce() -> Result<[u8; NONCE], CommError> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n).map_err(|e| CommError::Store(format!("no randomness for the store handshake: {e}")))?;
    Ok(n)
}

fn mac(token: &[u8], role: Role, client_nonce: &[u8], server_nonce: &[u8]) -> Hmac<Sha256> {
    let mut m = Hmac::<Sha256>::new_from_slice(token).expect("HMAC takes keys of any length");
    m.update(match role {
        Role::Server => b"comm store server proof v2",
        Role::Client => b"comm store client proof v2",
    });
    m.update(client_nonce);
    m.update(server_nonce);
    m
}

/// `role`'s proof that it knows `token`, for this pair of nonces.
pub(crate) fn prove(token: &[u8], role: Role, client_nonce: &[u8], server_nonce: &[u8]) -> [u8; PROOF] {
    mac(token, role, client_nonce, server_nonce).finalize().into_bytes().into()
}

/// Whether `proof` is `role`'s proof for `token` (compared in constant time).
pub(crate) fn verify(token: &[u8], role: Role, client_nonce: &[u8], server_nonce: &[u8], proof: &[u8]) -> bool {
    mac(token, role, client_nonce, server_nonce).verify_slice(proof).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_token_role_and_nonces() {
        let (c, s) = (nonce().unwrap(), nonce().unwrap());
        assert_ne!(c, s);
        let p = prove(b"secret", Role::Server, &c, &s);
        assert!(verify(b"secret", Role::Server, &c, &s, &p));
        assert!(!verify(b"other", Role::Server, &c, &s, &p), "another token");
        assert!(!verify(b"secret", Role::Client, &c, &s, &p), "reflected to the other role");
        assert!(!verify(b"secret", Role::Server, &s, &c, &p), "other nonces");
        assert!(!verify(b"secret", Role::Server, &c, &s, &p[..31]), "truncated");
        // An empty token is a key like any other: jobs without one still tell a token apart.
        let e = prove(b"", Role::Client, &c, &s);
        assert!(verify(b"", Role::Client, &c, &s, &e) && !verify(b"x", Role::Client, &c, &s, &e));
    }
}
