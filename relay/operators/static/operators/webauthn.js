// Security keys and passkeys (WebAuthn) for the admin's second step; no inline script (CSP).
"use strict";
(function () {
  function toBytes(value) {
    const text = atob(value.replace(/-/g, "+").replace(/_/g, "/") + "===".slice((value.length + 3) % 4));
    return Uint8Array.from(text, (c) => c.charCodeAt(0));
  }
  function toText(buffer) {
    const bytes = new Uint8Array(buffer);
    let text = "";
    bytes.forEach((b) => { text += String.fromCharCode(b); });
    return btoa(text).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
  }
  function csrf(form) { return form.querySelector("input[name=csrfmiddlewaretoken]").value; }
  async function post(form, url, body) {
    const response = await fetch(url, {
      method: "POST", credentials: "same-origin",
      headers: {"Content-Type": "application/json", "X-CSRFToken": csrf(form)},
      body: JSON.stringify(body || {}),
    });
    const data = await response.json();
    if (!response.ok && !data.next) { throw new Error(data.error || response.statusText); }
    return data;
  }
  function showError(message) {
    const box = document.getElementById("passkey-error");
    box.textContent = message;
    box.hidden = false;
  }

  async function register(form) {
    const options = await post(form, form.dataset.optionsUrl);
    options.challenge = toBytes(options.challenge);
    options.user.id = toBytes(options.user.id);
    (options.excludeCredentials || []).forEach((c) => { c.id = toBytes(c.id); });
    const credential = await navigator.credentials.create({publicKey: options});
    const name = document.getElementById("id_key_name").value;
    const result = await post(form, form.dataset.registerUrl, {name: name, credential: {
      id: credential.id, rawId: toText(credential.rawId), type: credential.type,
      authenticatorAttachment: credential.authenticatorAttachment,
      clientExtensionResults: credential.getClientExtensionResults(),
      response: {
        clientDataJSON: toText(credential.response.clientDataJSON),
        attestationObject: toText(credential.response.attestationObject),
        transports: credential.response.getTransports ? credential.response.getTransports() : [],
      },
    }});
    window.location.assign(result.next);
  }

  async function authenticate(form) {
    const options = await post(form, form.dataset.optionsUrl);
    options.challenge = toBytes(options.challenge);
    (options.allowCredentials || []).forEach((c) => { c.id = toBytes(c.id); });
    const credential = await navigator.credentials.get({publicKey: options});
    const result = await post(form, form.dataset.verifyUrl, {next: form.dataset.next, credential: {
      id: credential.id, rawId: toText(credential.rawId), type: credential.type,
      authenticatorAttachment: credential.authenticatorAttachment,
      clientExtensionResults: credential.getClientExtensionResults(),
      response: {
        clientDataJSON: toText(credential.response.clientDataJSON),
        authenticatorData: toText(credential.response.authenticatorData),
        signature: toText(credential.response.signature),
        userHandle: credential.response.userHandle ? toText(credential.response.userHandle) : null,
      },
    }});
    window.location.assign(result.next);
  }

  function bind(id, run) {
    const form = document.getElementById(id);
    if (!form) { return; }
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      run(form).catch((error) => showError(error.message || String(error)));
    });
  }
  document.addEventListener("DOMContentLoaded", () => {
    bind("passkey-new-form", register);
    bind("passkey-form", authenticate);
  });
})();
